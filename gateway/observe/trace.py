"""Traffic traces: request shapes only, never text.

A trace is JSON lines, one request each::

    {"t": 12.5, "model": "qwen3.6", "prompt_tokens": 3012, "prompt_bytes": 9120,
     "prompt_chars": 9050, "output_tokens": 37, "stream": true, "prefix": "agent-3"}

``t`` is seconds from the start of the trace; ``prompt_chars`` may be null in captured traces
(the gateway counts bytes and tokens, not characters); ``prefix`` names a shared prompt prefix
and ``prefix_tokens``, when known, its length: requests naming the same prefix share their first
``prefix_tokens`` tokens, so a replay predicts prefix-cache hits (``PrefixSim``,
tuning/prefix_routers.py).

- ``synthesize(kind, seed)`` makes a trace from a description: ``production-burst`` (658
  requests over three hours, p50 prompt 3,000 tokens with 37 output tokens, nine monsters of
  100k to 720k tokens with ~124 output tokens, a dozen 40k-90k-token JSON tool results; content
  mixed prose/code/JSON so characters per token vary) or ``burst-32k`` (40 requests of ~32k
  tokens within seconds) or ``agent-storm`` (a second burst shape, below) or ``shared-prefix``
  (agents with long system prompts and documents asked many questions, below). Same seed, same
  trace.
- ``TraceWriter`` records live traffic (``state.trace_file``): ``record`` only appends to a
  bounded buffer on the request path (past the bound, lines are dropped: memory stays flat when
  the disk stalls); ``run`` writes it out once a second off the event loop.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import anyio
import orjson

SYNTH_KINDS: tuple[str, ...] = ("production-burst", "burst-32k", "agent-storm", "shared-prefix")
# Characters per Qwen3 token by content (shared/FACTS.md): prose ~5, code ~4.5, dense JSON ~2.1.
CHARS_PER_TOKEN = {"prose": 4.9, "code": 4.4, "json": 2.1}


@dataclass(frozen=True, slots=True)
class TraceRecord:
    t: float
    model: str
    prompt_tokens: int
    prompt_bytes: int
    output_tokens: int
    stream: bool = True
    prompt_chars: int | None = None
    prefix: str | None = None
    # The request's priority class (gateway/request/classes.py); None: the policy's default.
    priority: str | None = None
    # How many leading tokens the requests naming ``prefix`` share (None: unknown).
    prefix_tokens: int | None = None

    @property
    def chars(self) -> int:
        """Characters, or bytes where a captured trace has no character count."""
        return self.prompt_chars if self.prompt_chars is not None else self.prompt_bytes


def read_trace(path: str | Path) -> list[TraceRecord]:
    records = []
    with Path(path).open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                records.append(TraceRecord(**orjson.loads(line)))
            except (orjson.JSONDecodeError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record: {exc}") from exc
    return sorted(records, key=lambda r: r.t)


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    with Path(path).open("wb") as handle:
        for record in records:
            handle.write(orjson.dumps(asdict(record)) + b"\n")


def _shape(
    rng: random.Random, t: float, tokens: int, output: int, model: str, prefix: str | None
) -> TraceRecord:
    kind = rng.choices(("prose", "code", "json"), weights=(0.5, 0.3, 0.2))[0]
    chars = int(tokens * CHARS_PER_TOKEN[kind] * rng.uniform(0.9, 1.1))
    multibyte = rng.random() < 0.1  # some CJK or emoji: more bytes than characters
    return TraceRecord(
        t=round(t, 3),
        model=model,
        prompt_tokens=tokens,
        prompt_bytes=int(chars * (1.6 if multibyte else 1.0)),
        output_tokens=output,
        stream=rng.random() < 0.8,
        prompt_chars=chars,
        prefix=prefix,
    )


def _production_burst(rng: random.Random, model: str) -> Iterator[TraceRecord]:
    """658 requests over three hours. Agents fan out: about 60% of the small requests come in
    a dozen bursts of 30-60 requests within ten seconds, the rest trickle in. Two thirds of the
    nine monsters open a burst (an agent loads a huge context, then its workers fire), which is
    when one monster prefill hurts the most requests; the others land anywhere. A dozen
    mid-size dense-JSON tool results (40k-90k tokens, ~2 characters a token) sit between: heavy
    by tokens, light by characters / 4."""
    duration, total, monsters, dumps = 3 * 3600.0, 658, 9, 12
    small = total - monsters - dumps
    bursts = sorted(rng.uniform(60, duration - 60) for _ in range(12))
    times: list[float] = []
    for start in bursts:
        times.extend(start + rng.uniform(1, 11) for _ in range(rng.randint(30, 60)))
    times = times[: int(small * 0.6)]
    times.extend(rng.uniform(0, duration) for _ in range(small - len(times)))
    for i, t in enumerate(sorted(times)):
        tokens = min(30_000, max(200, int(rng.lognormvariate(math.log(3000), 0.7))))
        output = min(2000, max(1, int(rng.lognormvariate(math.log(37), 0.6))))
        yield _shape(rng, t, tokens, output, model, f"agent-{i % 12}")
    for _ in range(dumps):
        tokens = rng.randint(40_000, 90_000)
        chars = int(tokens * CHARS_PER_TOKEN["json"] * rng.uniform(0.9, 1.1))
        yield TraceRecord(
            t=round(rng.uniform(0, duration), 3),
            model=model,
            prompt_tokens=tokens,
            prompt_bytes=chars,
            output_tokens=60,
            prompt_chars=chars,
        )
    opening = rng.sample(bursts, 6)
    for i in range(monsters):
        at = opening[i] if i < len(opening) else rng.uniform(0, duration * 0.9)
        tokens = int(math.exp(rng.uniform(math.log(100_000), math.log(720_000))))
        output = max(16, int(rng.gauss(124, 30)))
        yield _shape(rng, at, tokens, output, model, None)


def _agent_storm(rng: random.Random, model: str) -> Iterator[TraceRecord]:
    """A second burst shape: two hours, eight storms of 80-165 agent calls landing within three
    seconds (batch class: background agents), short chat turns trickling in all along
    (interactive class: a person waiting), and ten monsters of 150k-600k tokens, most of them
    arriving one to five seconds before a storm, the rest anywhere. Prompts are shorter than
    production-burst's (p50 ~1,500 tokens) and answers longer (p50 ~60 tokens)."""
    duration = 2 * 3600.0
    storms = sorted(rng.uniform(120, duration - 120) for _ in range(8))
    for start in storms:
        for _ in range(rng.randint(80, 165)):
            tokens = min(24_000, max(100, int(rng.lognormvariate(math.log(1500), 0.8))))
            output = min(1000, max(1, int(rng.lognormvariate(math.log(60), 0.5))))
            record = _shape(rng, start + rng.uniform(0, 3), tokens, output, model, "storm")
            yield replace(record, priority="batch")
    for _ in range(300):
        tokens = min(16_000, max(50, int(rng.lognormvariate(math.log(800), 0.7))))
        output = min(600, max(1, int(rng.lognormvariate(math.log(50), 0.5))))
        record = _shape(rng, rng.uniform(0, duration), tokens, output, model, None)
        yield replace(record, priority="interactive")
    before = rng.sample(storms, 6)
    for i in range(10):
        at = before[i] - rng.uniform(1, 5) if i < len(before) else rng.uniform(0, duration)
        tokens = int(math.exp(rng.uniform(math.log(150_000), math.log(600_000))))
        yield _shape(rng, at, tokens, max(16, int(rng.gauss(150, 40))), model, None)


def _shared_prefix(rng: random.Random, model: str) -> Iterator[TraceRecord]:
    """Twenty minutes of prefix reuse. 160 agents, each with its own system prompt of 8k-20k
    tokens (2.2M tokens in all: more than one fast engine's KV cache holds, less than four's),
    each calling at its own rate (log-normal, ~2.4 requests a second in all) with a fresh
    100-3,000-token tail after the system prompt. Ten documents of 150k-300k tokens (2.25M in
    all: more than one heavy engine's KV cache holds beside its running monsters' need, less
    than two's), each asked six questions (50-400 tokens after the document) in three bursts
    of two a few seconds apart: repeated-document monsters. Every record carries its prefix
    and its length."""
    duration, agents = 1200.0, 160
    for a in range(agents):
        system = rng.randint(8_000, 20_000)
        rate = rng.lognormvariate(math.log(2.4 / agents), 0.8)
        t = rng.uniform(0, 30)
        while t < duration:
            tokens = system + rng.randint(100, 3_000)
            output = min(600, max(1, int(rng.lognormvariate(math.log(37), 0.6))))
            record = _shape(rng, t, tokens, output, model, f"agent-{a}")
            yield replace(record, prefix_tokens=system)
            t += rng.expovariate(rate)
    for d in range(10):
        document = rng.randint(150_000, 300_000)
        for burst in sorted(rng.uniform(30, duration - 200) for _ in range(3)):
            for _ in range(2):
                tokens = document + rng.randint(50, 400)
                at = burst + rng.uniform(0, 5)
                record = _shape(rng, at, tokens, max(16, int(rng.gauss(124, 30))), model, None)
                yield replace(record, prefix=f"doc-{d}", prefix_tokens=document)


def _burst_32k(rng: random.Random, model: str) -> Iterator[TraceRecord]:
    for _ in range(40):
        tokens = int(rng.uniform(30_500, 33_500))
        yield _shape(rng, rng.uniform(0, 5), tokens, max(8, int(rng.gauss(60, 15))), model, None)


def synthesize(kind: str, seed: int = 0, model: str = "qwen3.6") -> list[TraceRecord]:
    rng = random.Random(seed)
    if kind == "production-burst":
        records = list(_production_burst(rng, model))
    elif kind == "burst-32k":
        records = list(_burst_32k(rng, model))
    elif kind == "agent-storm":
        records = list(_agent_storm(rng, model))
    elif kind == "shared-prefix":
        records = list(_shared_prefix(rng, model))
    else:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(SYNTH_KINDS)}")
    return sorted(records, key=lambda r: r.t)


class TraceWriter:
    """Captures the shape of live requests; the request path only appends to a buffer."""

    def __init__(self, path: Path, max_buffer: int = 100_000) -> None:
        self.path = path
        self._buffer: list[bytes] = []
        self._max = max_buffer
        self._origin = time.monotonic()

    def record(
        self, model: str, prompt_tokens: int, prompt_bytes: int, output_tokens: int, stream: bool
    ) -> None:
        if len(self._buffer) >= self._max:
            return  # a writer 100,000 requests behind: the disk is stuck, and memory stays flat
        shape = TraceRecord(
            t=round(time.monotonic() - self._origin, 3),
            model=model,
            prompt_tokens=prompt_tokens,
            prompt_bytes=prompt_bytes,
            output_tokens=output_tokens,
            stream=stream,
        )
        self._buffer.append(orjson.dumps(shape) + b"\n")

    def flush(self) -> None:
        lines, self._buffer = self._buffer, []
        if lines:
            with self.path.open("ab") as handle:
                handle.writelines(lines)

    async def run(self) -> None:
        try:
            while True:
                await anyio.sleep(1.0)
                await anyio.to_thread.run_sync(self.flush)
        finally:
            self.flush()
