"""The relay of a stream that may migrate: one client stream spliced across every engine that
served it, pure (gateway/request/migration.py decides how it continues; forward.py feeds it).

    Relay(kind, collect_ids, strip_ids, ask_ids)   one client stream across every engine
      relay.feed(chunk) -> bytes                   whole SSE events to pass on now
      relay.rest() -> bytes                        what is left of a stream that ended cleanly
      relay.failure                                an engine error event seen (held back)
      relay.diverged                               a replay did not repeat the answer relayed
      relay.so_far() -> SoFar                      the answer relayed so far
      relay.spliced(prompt_tokens, by)             the next engine's stream continues it

Splicing: only whole SSE events reach the client (a cut event is dropped, and sent again by the
continuation), so the text relayed is exactly the text the client has. A continuation's events
are rewritten: the first stream's ``id`` and ``created``, no second role chunk, and usage made
the whole answer's (prompt tokens of the original prompt, completion tokens plus those relayed
before). An error event is held back while the answer can still migrate. The token ids are
collected for a continuation from them; a replay's first tokens are checked against them.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from engine_pool.engine_api import RouteKind
from gateway.request.migration import SoFar

EVENT_END = b"\n\n"
DATA = b"data: "
DONE = b"[DONE]"
ERROR_HEAD = b'data: {"error"'
# Relayed events are kept as bytes and folded into text past this size: the parse is paid once
# per event, and only by streams that keep going; memory stays bounded.
KEEP_MAX = 16384
# The token ids vLLM sends when asked (migration.py's IDS_FIELD): ``prompt_token_ids`` on the
# first chunk (chat: the chunk; completions: its choice), ``token_ids`` on every choice.
TOKEN_IDS = re.compile(rb'"(prompt_)?token_ids":(null|\[[0-9, ]*\])')


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
