"""A vLLM-V1-like step scheduler over token counts. Pure: no clock, no I/O, no asyncio.

Each ``step(now)`` follows vLLM V1's ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py,
checked in 0.32) within a budget of ``max_num_batched_tokens`` tokens:

1. running sequences, in the order they were admitted, take their tokens while budget is left:
   one for a sequence that decodes, the next chunk of its prompt for one still prefilling;
2. waiting sequences that have arrived by ``now`` are admitted first-come-first-served into the
   rest of the budget (chunked prefill). The head of the queue blocks everyone behind it: it
   waits while ``max_num_seqs`` are running or while its KV reservation does not fit.

With ``long_prefill_token_threshold`` = 0 (vLLM's default) a prefill takes all the budget the
decodes leave, so only a prompt's last chunk leaves room for the next request: one prompt is
part-way through its prefill at a time, and a waiting 3k prompt behind a 359k prompt waits for
the whole 359k prefill. With a threshold, a prompt takes at most that many tokens a step while
another request is running or waiting (vLLM drops the cap when a request is alone), so the rest
of the budget admits the requests behind it and several prefills advance side by side: a short
question runs beside a long document's read.

The step that completes a prompt's prefill also samples its first output token (as vLLM does).
A sequence finishes when it has generated ``output_tokens``; its seat and KV are freed at once,
as they are on ``abort``. KV is reserved at admission for prompt + output tokens, so a running
sequence is never preempted; ``kv_used_tokens`` reports the tokens actually cached.

With a prefix cache (``prefix_cache.BlockCache``, ``Scheduler(..., cache=, block_tokens=)``) a
request added with its prompt's block keys looks them up when it is admitted (not when it
arrives: a request queued behind the prefill of the same document finds it cached, as in vLLM)
and skips the prefill of the blocks held; its full blocks are stored when the chunk that
computes them is scheduled, as vLLM V1's ``allocate_slots`` caches them: a request admitted later
in the same step finds them (they are written before it attends to them in that forward pass),
a request admitted before them in the step does not. So a request queued behind another's
prefill of the same prompt (no threshold) is admitted with that prefill's last chunk and finds
the whole prompt but its last partial block; one admitted beside a prefill in progress (with a
threshold) finds what has been scheduled so far and computes the rest itself.
``hits`` maps each such request's key to the prompt tokens it found cached.

``step`` returns a frozen ``StepResult`` (what ran, how long it took in simulated seconds, who
got a token) or ``None`` when nothing can run at ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from engine_pool.sim.costs import step_cost
from engine_pool.sim.prefix_cache import BlockCache
from engine_pool.sim.profile import CostParams, SchedulerLimits


@dataclass(slots=True)
class _Seq:
    key: str
    prompt_tokens: int
    output_tokens: int
    arrival: float
    computed: int = 0
    generated: int = 0
    blocks: Sequence[Hashable] = field(default=())

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.prompt_tokens

    @property
    def context(self) -> int:
        return self.computed + self.generated

    @property
    def reservation(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class StepResult:
    start: float
    duration: float
    # (key, tokens) prefill chunks run in this step.
    prefill: tuple[tuple[str, int], ...]
    # Keys that got one output token at the end of the step (first tokens included).
    tokens: tuple[str, ...]
    first_tokens: tuple[str, ...]
    # Keys whose last token is in ``tokens``; they have left the engine.
    finished: tuple[str, ...]

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def decodes(self) -> int:
        return len(self.tokens) - len(self.first_tokens)


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    running: int
    waiting: int
    kv_used_tokens: int
    kv_reserved_tokens: int
    kv_capacity_tokens: int

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        costs: CostParams,
        cache: BlockCache | None = None,
        block_tokens: int = 16,
    ) -> None:
        self._limits = limits
        self.cache = cache
        self._block_tokens = block_tokens
        self.hits: dict[str, int] = {}
        self._costs = costs
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._reserved = 0
        self._keys: set[str] = set()

    def add(
        self,
        key: str,
        prompt_tokens: int,
        output_tokens: int,
        arrival: float,
        blocks: Sequence[Hashable] = (),
    ) -> None:
        """Queue a request; keys must be unique among live requests. ``blocks``: its prompt's
        block keys, looked up in the prefix cache when it is admitted (none: no lookup)."""
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("a request needs at least one prompt and one output token")
        if prompt_tokens + output_tokens > self._limits.kv_capacity_tokens:
            raise ValueError("request cannot fit in the KV cache even when it is empty")
        if key in self._keys:
            raise ValueError(f"duplicate request key {key!r}")
        self._keys.add(key)
        self._waiting.append(_Seq(key, prompt_tokens, output_tokens, arrival, blocks=blocks))

    def __contains__(self, key: str) -> bool:
        """The request is live here (queued or running)."""
        return key in self._keys

    def abort(self, key: str) -> bool:
        """Remove a request wherever it is; True if it was live."""
        if key not in self._keys:
            return False
        self._keys.discard(key)
        seq = self._running.pop(key, None)
        if seq is not None:
            self._reserved -= seq.reservation
            return True
        for seq in self._waiting:
            if seq.key == key:
                self._waiting.remove(seq)
                return True
        return False

    def abort_all(self) -> list[str]:
        keys = [*self._running, *(s.key for s in self._waiting)]
        for key in keys:
            self.abort(key)
        return keys

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def next_arrival(self) -> float | None:
        """Arrival time of the head of the waiting queue (what an idle engine waits for)."""
        return self._waiting[0].arrival if self._waiting else None

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_used_tokens=sum(s.context for s in self._running.values()),
            kv_reserved_tokens=self._reserved,
            kv_capacity_tokens=self._limits.kv_capacity_tokens,
        )

    def _admit(self, now: float, budget: int, cap: int) -> list[tuple[_Seq, int]]:
        chunks: list[tuple[_Seq, int]] = []
        limits = self._limits
        while self._waiting and budget > 0:
            head = self._waiting[0]
            if head.arrival > now or len(self._running) >= limits.max_num_seqs:
                break
            if self._reserved + head.reservation > limits.kv_capacity_tokens:
                break
            self._waiting.popleft()
            self._running[head.key] = head
            self._reserved += head.reservation
            if self.cache is not None and head.blocks:
                # A hit skips those blocks' prefill; the last prompt token is always computed.
                held = self.cache.hit(head.blocks) * self._block_tokens
                head.computed = min(held, head.prompt_tokens - 1)
                self.hits[head.key] = head.computed
            n = _chunk(head.prompt_tokens - head.computed, cap, budget)
            self._schedule(head, n)
            chunks.append((head, n))
            budget -= n
        return chunks

    def _schedule(self, seq: _Seq, n: int) -> None:
        """``n`` prompt tokens of ``seq`` run this step: their full blocks are cached now (vLLM
        V1 caches a block when its slots are allocated, before the step runs)."""
        if self.cache is not None and seq.blocks:
            self.cache.store(seq.blocks[: (seq.computed + n) // self._block_tokens])

    def _cap(self, now: float) -> int:
        """The threshold in force this step: none while one request is alone (as vLLM does)."""
        threshold = self._limits.long_prefill_token_threshold
        if threshold == 0:
            return 0
        others = len(self._running)
        for seq in self._waiting:
            if others > 1 or seq.arrival > now:
                break
            others += 1
        return threshold if others > 1 else 0

    def step(self, now: float) -> StepResult | None:
        cap = self._cap(now)
        budget = self._limits.max_num_batched_tokens
        decodes: list[_Seq] = []
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._running.values():
            if budget <= 0:
                break
            if seq.prefilled:
                decodes.append(seq)
                budget -= 1
            else:
                n = _chunk(seq.prompt_tokens - seq.computed, cap, budget)
                self._schedule(seq, n)
                chunks.append((seq, n))
                budget -= n
        chunks.extend(self._admit(now, budget, cap))
        if not decodes and not chunks:
            return None
        duration = step_cost(
            self._costs, [(s.computed, n) for s, n in chunks], [s.context for s in decodes]
        )
        tokens: list[str] = []
        first: list[str] = []
        for seq, n in chunks:
            seq.computed += n
            if seq.prefilled:
                seq.generated = 1
                tokens.append(seq.key)
                first.append(seq.key)
        for seq in decodes:
            seq.generated += 1
            tokens.append(seq.key)
        finished = [
            k for k in tokens if self._running[k].generated >= self._running[k].output_tokens
        ]
        for key in finished:
            self.abort(key)
        return StepResult(
            start=now,
            duration=duration,
            prefill=tuple((s.key, n) for s, n in chunks),
            tokens=tuple(tokens),
            first_tokens=tuple(first),
            finished=tuple(finished),
        )


def _chunk(remaining: int, cap: int, budget: int) -> int:
    """Prompt tokens a sequence computes this step: what is left, capped, within the budget."""
    if 0 < cap < remaining:
        remaining = cap
    return min(remaining, budget)
