"""What the simulated engine needs from whoever starts it: a reader of vLLM's requests that
knows the model's tokenizer.

A stand-in engine must see the prompt tokens a real vLLM would, so it counts with the model's
real tokenizer and chat template rather than an estimate, and reads requests as the gateway
does. That code is the gateway's (``gateway/protocols/openai.py``, ``gateway/protocols/``,
``gateway/count/tokens.py``), and ``engine_pool`` never imports ``gateway``: the sim is handed a
``PromptCounter`` instead. The gateway's is ``gateway.tools.sim_support.RegistryCounter``, which
``shapegate sim``, the demo, the benchmarks and the tests pass in. The sim keeps its own routes
(which path is which ``RouteKind``) and its own wire format (``wire.py``, ``wire_apis.py``).

Contract of a ``PromptCounter`` (calls are blocking: the app runs ``count``, ``pooled``,
``detokenize`` and ``tokenize`` in a worker thread, so a 300k-token prompt does not stall the
event loop); every reader raises ``RequestRejected(message, param)`` for what vLLM answers with
400:
- ``read(kind, body)`` parses a JSON request body of any route but ``/tokenize`` into a
  ``SimRequest``.
- ``read_form(kind, content_type, body)`` reads a multipart/form-data body (the audio
  routes): only its ``model`` matters; its prompt is empty.
- ``count(request)``: the exact prompt tokens of a request a reader returned (a pooling
  request's largest sequence, as the gateway counts it). A prompt the chat template refuses
  (an unknown role: "Unexpected message role.") raises ``RequestRejected``, as vLLM answers 400.
- ``counts(request)``: the exact prompt tokens of each prompt of a completions batch, in order
  (one entry for any other request); vLLM serves each as its own sequence.
- ``pooled(request)``: the texts a pooling request pools, one per input (a pair joined for score
  and rerank; a chat rendered by its template; token ids written out).
- ``detokenize(request)``: the text of a ``/detokenize`` request's token ids (special tokens
  included); ``RequestRejected`` for an id the vocabulary lacks.
- ``tokenize(data)``: token ids for ``/tokenize``'s JSON body (``prompt``, text or token ids, or
  chat ``messages`` rendered by the template); None when it has neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine_pool.engine_api import RouteKind


@dataclass(frozen=True, slots=True)
class SimRequest:
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    # Prompts in the request: a completions batch has more than one (one choice each).
    prompts: int
    # The reader's own parsed prompt, handed back to its ``count``; the sim never looks inside.
    prompt: object
    # Responses only: the stored response this one continues (404 when the engine lacks it).
    previous_response_id: str | None = None


class RequestRejected(Exception):
    """A request vLLM answers with 400; ``param`` names the offending field where known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PromptCounter(Protocol):
    def read(self, kind: RouteKind, body: bytes) -> SimRequest: ...

    def read_form(self, kind: RouteKind, content_type: bytes | None, body: bytes) -> SimRequest: ...

    def count(self, request: SimRequest) -> int: ...

    def counts(self, request: SimRequest) -> list[int]: ...

    def pooled(self, request: SimRequest) -> list[str]: ...

    def detokenize(self, request: SimRequest) -> str: ...

    def tokenize(self, data: Any) -> list[int] | None: ...
