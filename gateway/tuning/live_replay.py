"""``shapegate replay --live URL TRACE``: a trace played against a running gateway or engine.

Contract:
- ``PromptBuilder(counter, model)`` makes, for each traced request, a chat prompt of exactly the
  traced ``prompt_tokens`` for the target model: words that are one token each, every prompt
  different (no count cache or prefix cache makes it cheaper than the traced one), counted with
  the model's own tokenizer and chat template (``gateway/count/tokens.py``, the gateway's parser)
  and corrected until the count matches; a prompt that cannot match raises ``ValueError``. The
  target's own count (``usage.prompt_tokens`` of the stream) is recorded as well, so a target
  with another tokenizer shows up as ``count_mismatches``.
- ``play(url, trace, prompts, time_scale, deadline_s)`` sends each request at
  ``t x time_scale`` wall seconds after the start (the engines' clock runs 1/S faster), streaming,
  ``max_tokens`` the traced output length; records send lag, first token, end, status and the
  ``x-shapegate-lane`` / ``x-shapegate-cluster`` headers. It stops by itself: at the deadline the
  requests still open are cancelled and reported ``unfinished``. ``progress(sent, done, total)``
  hears every change (the CLI draws a bar on stderr).
- ``as_result(settings, plays, time_scale)`` turns the measurements into the replay's own
  ``FleetResult`` in the engines' seconds (wall / S), so ``replay.summarize`` and ``render``
  give the same tables as ``--simulate`` (``live_report.py`` puts live beside a prediction).

No text of a real prompt is involved: traces carry shapes only.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from gateway.count.tokens import TokenCounter
from gateway.observe.trace import TraceRecord
from gateway.protocols.routes import ENGINE_ROUTES
from gateway.request.lanes import lane_for
from gateway.settings import Settings
from gateway.tuning.fleet_result import FleetResult, SimulatedRequest

# Common English words; those the target's tokenizer encodes as one token (with and without a
# leading space) make the filler.
_CANDIDATES = (
    "route",
    "token",
    "lane",
    "slot",
    "engine",
    "queue",
    "batch",
    "model",
    "cache",
    "prefill",
    "decode",
    "time",
    "data",
    "text",
    "word",
    "line",
    "file",
    "code",
    "test",
    "case",
    "user",
    "value",
    "state",
    "table",
    "order",
    "group",
    "point",
    "world",
    "house",
    "water",
    "light",
    "paper",
    "music",
    "river",
    "money",
    "story",
    "field",
    "power",
)


@dataclass(frozen=True, slots=True)
class Play:
    """One traced request as played. Times are wall seconds since the start of the play."""

    index: int
    record: TraceRecord
    scheduled: float
    # time.time() at the play's start: wall offsets + origin compare with an engine's records.
    origin_epoch: float = 0.0
    sent: float | None = None
    status: int | None = None
    lane: str | None = None
    cluster: str | None = None
    first_token: float | None = None
    finished: float | None = None
    target_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def lag(self) -> float | None:
        return None if self.sent is None else self.sent - self.scheduled


class PromptBuilder:
    """Chat messages of an exact token count for one model, verified by its tokenizer."""

    def __init__(self, counter: TokenCounter, model: str, seed: int = 0) -> None:
        self._counter = counter
        self._model = model
        self._rng = random.Random(seed)
        self._parse = ENGINE_ROUTES["/v1/chat/completions"].parse
        self.words = [
            w
            for w in _CANDIDATES
            if len(counter.encode(model, " " + w)) == 1 and len(counter.encode(model, w)) == 1
        ]
        if len(self.words) < 4:
            raise ValueError(f"model {model!r}: too few one-token words to build prompts")

    def count(self, messages: list[dict[str, str]]) -> int:
        """The prompt's tokens as the gateway counts them: its parser, the model's template."""
        assert self._parse is not None
        body = orjson.dumps({"model": self._model, "messages": messages})
        prompt = self._parse(body).prompt
        return self._counter.count_sync(self._model, prompt, exact_above=0).tokens

    def build(self, index: int, tokens: int) -> list[dict[str, str]]:
        words = self._rng.choices(self.words, k=max(0, tokens))
        head = f"r{index}"
        for _ in range(6):
            messages = [{"role": "user", "content": head + "".join(" " + w for w in words)}]
            found = self.count(messages)
            if found == tokens:
                return messages
            delta = tokens - found
            if delta > 0:
                words.extend(self._rng.choices(self.words, k=delta))
            elif len(words) >= -delta:
                del words[delta:]
            else:
                break
        raise ValueError(
            f"cannot build a prompt of exactly {tokens} tokens for {self._model!r} "
            f"(the chat template alone takes more, or the count does not converge)"
        )


def request_id(index: int) -> str:
    """The ``X-Request-Id`` of the trace's request ``index`` (an engine's records carry it)."""
    return f"replay-{index}"


def _first_content(line: bytes) -> bool:
    """Does this SSE data line carry generated text (not the role-only opening chunk)?"""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices:
        return False
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content"))


def _usage_tokens(line: bytes) -> int | None:
    if b'"usage":{' not in line and b'"usage": {' not in line:
        return None
    try:
        usage = orjson.loads(line).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    tokens = usage.get("prompt_tokens")
    return tokens if isinstance(tokens, int) else None


async def _one(
    client: httpx.AsyncClient,
    url: str,
    play: Play,
    messages: list[dict[str, str]],
    origin: float,
    done: Callable[[Play], None],
) -> None:
    record = play.record
    body = {
        "model": record.model,
        "messages": messages,
        "max_tokens": max(1, record.output_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    found: dict[str, Any] = {"sent": time.monotonic() - origin}
    try:
        async with client.stream(
            "POST",
            url + "/v1/chat/completions",
            content=orjson.dumps(body),
            headers={"content-type": "application/json", "x-request-id": request_id(play.index)},
        ) as response:
            found.update(
                status=response.status_code,
                lane=response.headers.get("x-shapegate-lane"),
                cluster=response.headers.get("x-shapegate-cluster"),
            )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = line[6:].encode()
                if "first_token" not in found and _first_content(data):
                    found["first_token"] = time.monotonic() - origin
                tokens = _usage_tokens(data)
                if tokens is not None:
                    found["target_prompt_tokens"] = tokens
            found["finished"] = time.monotonic() - origin
    except httpx.HTTPError as exc:
        found["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    except asyncio.CancelledError:
        found["error"] = "unfinished"
        done(_played(play, found))
        raise
    done(_played(play, found))


def _played(play: Play, found: dict[str, Any]) -> Play:
    return Play(play.index, play.record, play.scheduled, play.origin_epoch, **found)


async def play(
    url: str,
    trace: Sequence[TraceRecord],
    prompts: Sequence[list[dict[str, str]]],
    time_scale: float,
    deadline_s: float,
    progress: Callable[[int, int, int], None] | None = None,
) -> list[Play]:
    """Every request sent at its traced time (scaled); all of them answered or cancelled by
    ``deadline_s`` wall seconds after the start."""
    results: dict[int, Play] = {}
    sent = 0

    def done(item: Play) -> None:
        results[item.index] = item
        if progress is not None:
            progress(sent, len(results), len(trace))

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(None, connect=10)  # a monster's prefill legitimately takes long
    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        origin, origin_epoch = time.monotonic(), time.time()
        tasks: list[asyncio.Task[None]] = []

        async def send_all() -> None:
            nonlocal sent
            for index, (record, messages) in enumerate(zip(trace, prompts, strict=True)):
                scheduled = record.t * time_scale
                await asyncio.sleep(max(0.0, origin + scheduled - time.monotonic()))
                item = Play(index, record, scheduled, origin_epoch)
                tasks.append(asyncio.create_task(_one(client, url, item, messages, origin, done)))
                sent += 1
                if progress is not None:
                    progress(sent, len(results), len(trace))
            await asyncio.gather(*tasks, return_exceptions=True)

        runner = asyncio.create_task(send_all())
        try:
            await asyncio.wait_for(asyncio.shield(runner), deadline_s)
        except TimeoutError:
            runner.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(runner, *tasks, return_exceptions=True)
    return [
        results.get(i, Play(i, record, record.t * time_scale, error="not_sent"))
        for i, record in enumerate(trace)
    ]


def as_result(settings: Settings, plays: Sequence[Play], time_scale: float) -> FleetResult:
    """The plays as the replay's ``FleetResult``, in the engines' seconds (wall / S), each
    measured from the request's own send."""
    outcomes = []
    for item in plays:
        record = item.record
        lane = item.lane or _lane_of(settings, record.prompt_tokens)
        key = f"r{item.index}"
        if item.status != 200 or item.finished is None or item.sent is None:
            why = item.error or f"http_{item.status}"
            outcomes.append(SimulatedRequest.of(key, record, lane, rejected=why))
            continue
        first = item.first_token if item.first_token is not None else item.finished
        outcomes.append(
            SimulatedRequest.of(
                key,
                record,
                lane,
                cluster=item.cluster,
                first_token=record.t + (first - item.sent) / time_scale,
                finished=record.t + (item.finished - item.sent) / time_scale,
            )
        )
    makespan = max((o.finished or o.arrival for o in outcomes), default=0.0)
    limits = {lane.name: lane.slots.lane for lane in settings.lanes}
    return FleetResult(tuple(outcomes), (), limits, makespan)


def _lane_of(settings: Settings, tokens: int) -> str:
    lane = lane_for(tokens, settings.lanes)
    return lane.name if lane is not None else "none"
