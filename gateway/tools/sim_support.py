"""What the gateway lends its engine simulator: the request parser and the token counter.

``engine_pool`` never imports ``gateway``, yet a simulated engine must read requests and count
prompt tokens exactly as the gateway and a real vLLM do (the model's own tokenizer and chat
template). So the simulator declares what it needs (``engine_pool/sim/counting.py``,
``PromptCounter``) and this module implements it over the gateway's per-route parsers
(``gateway/protocols/routes.py``, ``gateway/protocols/``) and ``gateway/count/tokens.py``.

- ``RegistryCounter(counter, model)`` counts with an already loaded ``TokenCounter`` (tests and
  benchmarks share one between many simulated engines); ``RegistryCounter.for_profile(profile)``
  loads the profile's tokenizer (start-up cost: the vocabulary is read once).
- ``register(subparsers)`` adds ``shapegate sim`` (engine_pool/sim/cli.py) with this counter
  and the gateway's JSON logging.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import orjson

from engine_pool.engine_api import RouteKind
from engine_pool.sim.counting import RequestRejected, SimRequest
from gateway.errors import BadRequest
from gateway.protocols.multipart import parse_multipart
from gateway.protocols.openai import ChatPrompt, CompletionPrompt, Prompt, RoutedRequest
from gateway.protocols.routes import ENGINE_ROUTES

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine_pool.sim.profile import EngineProfile
    from gateway.count.tokens import TokenCounter

# Each JSON route's parser, by endpoint (the routes sharing an endpoint share its parser).
_PARSERS: dict[RouteKind, Callable[[bytes], RoutedRequest]] = {
    route.kind: route.parse for route in ENGINE_ROUTES.values() if route.parse is not None
}


def _sim_request(routed: RoutedRequest) -> SimRequest:
    prompt = routed.prompt
    prompts = (
        len(prompt.texts) + len(prompt.token_ids) if isinstance(prompt, CompletionPrompt) else 1
    )
    return SimRequest(
        model=routed.model,
        stream=routed.stream,
        include_usage=routed.include_usage,
        max_tokens=routed.max_tokens,
        prompts=prompts,
        prompt=prompt,
        previous_response_id=routed.previous_response_id,
    )


def _prompt(request: SimRequest) -> Prompt:
    prompt = request.prompt
    if not isinstance(prompt, ChatPrompt | CompletionPrompt):
        raise TypeError(f"not a prompt this counter read: {type(prompt).__name__}")
    return prompt


class RegistryCounter:
    """``PromptCounter`` over the gateway's parser and ``TokenCounter``, for one model."""

    def __init__(self, counter: TokenCounter, model: str) -> None:
        self._counter = counter
        self._model = model

    @classmethod
    def for_profile(cls, profile: EngineProfile) -> RegistryCounter:
        from gateway.count.tokens import TokenCounter

        model = {
            "name": profile.model,
            "aliases": list(profile.aliases),
            "tokenizer": profile.tokenizer,
            "max_model_len": profile.max_model_len,
        }
        return cls(TokenCounter.for_models([model]), profile.model)

    def read(self, kind: RouteKind, body: bytes) -> SimRequest:
        try:
            return _sim_request(_PARSERS[kind](body))
        except BadRequest as exc:
            raise RequestRejected(exc.message, exc.param) from exc

    def read_form(self, kind: RouteKind, content_type: bytes | None, body: bytes) -> SimRequest:
        try:
            return _sim_request(parse_multipart(kind, content_type, body))
        except BadRequest as exc:
            raise RequestRejected(exc.message, exc.param) from exc

    def count(self, request: SimRequest) -> int:
        # exact_above=0: the engine always counts exactly, never settles for a bound.
        try:
            return self._counter.count_sync(self._model, _prompt(request), exact_above=0).tokens
        except BadRequest as exc:  # the chat template refused the messages: vLLM's 400
            raise RequestRejected(exc.message, None) from exc

    def counts(self, request: SimRequest) -> list[int]:
        """Each prompt of a completions batch counted on its own (vLLM's one sequence each)."""
        prompt = _prompt(request)
        if not isinstance(prompt, CompletionPrompt) or request.prompts <= 1:
            return [self.count(request)]
        singles = [CompletionPrompt(texts=(text,)) for text in prompt.texts]
        singles += [CompletionPrompt(token_ids=(ids,)) for ids in prompt.token_ids]
        return [
            self._counter.count_sync(self._model, single, exact_above=0).tokens
            for single in singles
        ]

    def pooled(self, request: SimRequest) -> list[str]:
        prompt = _prompt(request)
        if isinstance(prompt, ChatPrompt):
            return [self._counter.render_chat(self._model, prompt)]
        return list(prompt.texts) or [",".join(map(str, ids)) for ids in prompt.token_ids]

    def detokenize(self, request: SimRequest) -> str:
        prompt = _prompt(request)
        if not isinstance(prompt, CompletionPrompt) or not prompt.token_ids:
            raise RequestRejected("'tokens' must be an array of token ids", "tokens")
        try:
            return self._counter.decode(self._model, prompt.token_ids[0])
        except ValueError as exc:
            raise RequestRejected(str(exc), "tokens") from exc

    def tokenize(self, data: Any) -> list[int] | None:
        """The ids of a /tokenize request, parsed as the gateway parses it (tools, template
        options and ``chat_template_kwargs`` honoured); None when it is not one."""
        try:
            prompt = _PARSERS["tokenize"](orjson.dumps(data)).prompt
        except (BadRequest, TypeError):
            return None
        if isinstance(prompt, ChatPrompt):
            return self._counter.encode(self._model, self._counter.render_chat(self._model, prompt))
        if prompt.texts:
            return self._counter.encode(self._model, prompt.texts[0])
        return list(prompt.token_ids[0]) if prompt.token_ids else None


def _json_logging(level: str) -> None:
    from gateway.observe.log import configure_logging

    configure_logging(level, json_output=True)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from engine_pool.sim import cli

    cli.register(
        subparsers, counter_for=RegistryCounter.for_profile, configure_logging=_json_logging
    )
