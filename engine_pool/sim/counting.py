"""What the simulated engine needs from whoever starts it: a reader of OpenAI requests that
knows the model's tokenizer.

A stand-in engine must see the prompt tokens a real vLLM would, so it counts with the model's
real tokenizer and chat template rather than an estimate, and reads requests as the gateway
does. That code is the gateway's (``gateway/protocol.py``, ``gateway/tokens.py``), and
``engine_pool`` never imports ``gateway``: the sim is handed a ``PromptCounter`` instead. The
gateway's is ``gateway.sim_support.RegistryCounter``, which ``shapegate sim``, the demo, the
benchmarks and the tests pass in.

Contract of a ``PromptCounter`` (calls are blocking: the app runs ``count`` and ``tokenize`` in
a worker thread, so a 300k-token prompt does not stall the event loop):
- ``read(endpoint, body)`` parses a request body into a ``SimRequest``, or raises
  ``RequestRejected(message, param)`` for what vLLM answers with 400.
- ``count(request)``: the exact prompt tokens of a request ``read`` returned.
- ``tokenize(data)``: token ids for ``/tokenize``'s JSON body (``prompt``, text or token ids, or
  chat ``messages`` rendered by the template); None when it has neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

# The OpenAI routes the sim serves (the same two a real engine serves the gateway).
Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True, slots=True)
class SimRequest:
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    # Prompts in the request: a completions batch has more than one (the sim serves one).
    prompts: int
    # The reader's own parsed prompt, handed back to its ``count``; the sim never looks inside.
    prompt: object


class RequestRejected(Exception):
    """A request vLLM answers with 400; ``param`` names the offending field where known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PromptCounter(Protocol):
    def read(self, endpoint: Endpoint, body: bytes) -> SimRequest: ...

    def count(self, request: SimRequest) -> int: ...

    def tokenize(self, data: Any) -> list[int] | None: ...
