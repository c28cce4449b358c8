"""How many prompt tokens will the engine see? The model's own vocabulary and chat template decide.

Contract:
- ``TokenCounter.from_settings(settings)`` loads and warms every model's tokenizer at start-up
  (never from the network; ``models.py``) and logs ``tokenizer.loaded`` once a model, with the
  backend in use and any fallback; a file that fails to load is a ``ConfigError`` naming the
  model and the file. The warm-up rehearses arrivals (``tokenizers/warmup.py``): each tokenizer
  counts a text as large as the lanes admit through the path requests take (logged as
  ``tokenizer.warmed`` with its time), and its child process encodes one as large.
- ``count(model, prompt, exact_above=N)`` answers in one of three ways (``TokenCount.method``):
  1. ``bound``: UTF-8 bytes of everything the template renders (of its NFC form where the
     tokenizer normalises; ``plan.py``). A byte-level BPE never emits more tokens than bytes, and
     each special token is one token for many bytes, so this is an upper bound (property-tested).
     Below ``exact_above`` it decides the route and no tokenizer runs on the request's path; it
     is never a token figure (``TokenCount.exact`` is None). ``start_exact(count)`` finishes it
     later from the plan the count kept (``plan.py``): inline when it can, else the cache looked
     up and the missing pieces left, which ``finish`` encodes in the worker; the pipeline runs
     it while the engine works.
  2. ``cache``: every piece of the prompt was counted before. A rendered prompt is cut before each
     ``<|im_start|>`` (one piece a ChatML message); special tokens are split out before any BPE
     runs, so piece counts add up exactly to the whole (tested against the full render). The LRU
     is keyed by SHA-256 of (tokenizer, piece): an agent's system prompt and earlier turns are
     counted once. A small prompt (up to ``DIRECT_MAX_BYTES``) is looked up first by one key a
     sequence, its pieces joined (a piece like any other: the same count), then by piece.
  3. ``exact``: the missing pieces are encoded. With gigatoken in its child process
     (``tokenizers/worker.py``, the default) a worker thread waits for the child, so the event
     loop never does; in-process, small ones inline and large ones in a worker thread with
     gigatoken's GIL-free batch call, so a 300k-token count leaves the event loop running (with
     the GIL held it would stall the loop for the whole count).
- Chat prompts: ``chat_template: chatml`` renders the built-in ChatML (``tokenizers/templates.py``
  lists what it renders and where it differs from Qwen3.6's own template), ``hf`` renders the
  model's Jinja template, ``none`` counts the message texts joined by newlines; ``auto`` (the
  default) is ``hf`` when the tokenizer ships a template, else ``chatml``. ``template_of(model)``
  is the mode in use; ``template_warnings(settings)`` names every model whose policy renders
  another template than the one its tokenizer ships (what vLLM renders): check-config prints
  them.
- Special-token strings inside messages (``<|im_end|>`` in user text) count as the special token:
  vLLM renders the template and tokenizes the result with Hugging Face semantics, which match
  added tokens anywhere in the text.
- Completions: each prompt counts its text plus what the tokenizer's post-processor adds (a BOS;
  none for Qwen); token-id prompts count as they are. For a batch of prompts ``tokens`` is the
  SUM, what vLLM reports as the batch's ``usage.prompt_tokens`` and what the engine prefills
  (each prompt is its own sequence, all admitted at once); ``largest`` is the largest single
  prompt, which is what must fit a context (``request/lanes.py`` ``lane_tokens`` uses both).
  A bound is the sum of the prompts' bounds. ``prompt_bytes`` covers all of them. Token-id
  prompts answer ``method="exact"`` with ``tokenizer="token_ids"`` (no tokenizer ran).
- Counts are Python ints. A template that rejects the messages raises ``BadRequest`` (the engine
  would answer 400); an unknown model raises ``ModelNotFound``.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gateway.core.count import Method, TokenCount
from gateway.count.models import load_models
from gateway.count.plan import Model, Plan, chat_pieces, plan_prompt
from gateway.count.tokenizers import cache, warmup
from gateway.count.tokenizers.child import warm_text
from gateway.count.tokenizers.encoders import GIL_FREE_ABOVE_CHARS
from gateway.errors import BadRequest, ModelNotFound
from gateway.observe.log import Logger, get_logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.protocols.openai import ChatPrompt, CompletionPrompt, Prompt
from gateway.settings import CountingSettings, Settings, parse_settings

# "none": nothing to count (a multipart audio request); its lane is named by the policy.
# Misses up to this many characters are counted on the event loop (under ~2 ms with the GIL
# held either way); longer ones go to the worker thread, where gigatoken releases the GIL.
INLINE_MAX_CHARS = GIL_FREE_ABOVE_CHARS
# Finishing a bound: up to this many bytes, encoding the prompt whole costs less than hashing its
# pieces for the cache (measured on a loaded 2-core machine: ~9 us against ~50 us for a 1 KB
# chat prompt, 18 against 64 at 8 KB; at 16 KB they meet), so small prompts skip the cache.
DIRECT_MAX_BYTES = 8192
# Token ids kept by piece for the prefix index's exact hashes (``prompt_ids``): 4 bytes an id,
# so 16 MB; about five 800k-token documents, or a thousand 4k-token system prompts.
IDS_CACHE_MAX_TOKENS = 4_194_304


@dataclass(frozen=True, slots=True)
class Unfinished:
    """A count under way, what ``TokenCounter.start_exact`` hands to ``finish``: the pieces no
    cache held (``texts``, at ``misses`` in the plan)."""

    plan: Plan
    counts: list[int | None]
    misses: list[int]
    keys: list[bytes]
    texts: list[str]
    started: float
    # A small prompt's sequence keys (``_whole``), stored with the count once it is known.
    whole: list[bytes] | None = None


class TokenCounter:
    def __init__(
        self,
        models: Mapping[str, Model],
        counting: CountingSettings,
        metrics: Metrics | None = None,
    ) -> None:
        self._models = dict(models)
        self._cache = cache.CountCache(counting.cache_entries)
        self._ids = cache.IdsCache(IDS_CACHE_MAX_TOKENS)
        self._metrics = metrics
        self._executor = (
            ThreadPoolExecutor(max_workers=counting.exact_workers, thread_name_prefix="count")
            if counting.exact_executor == "thread"
            else None
        )

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> TokenCounter:
        models, warm = load_models(settings, metrics)
        counter = cls(models, settings.counting, metrics)
        log = get_logger("tokens")
        for name, tokens in warm.items():
            if tokens > 0:
                try:
                    counter._warm_up(name, tokens, log)
                except BadRequest as exc:  # a template that refuses a lone user message
                    swallowed(log, metrics, "tokenizer.warm_up", exc, "served_without_warm_up")
        return counter

    def _warm_up(self, model: str, tokens: int, log: Logger) -> TokenCount:
        """The boot probe of counting: a chat prompt of about ``tokens`` tokens counted as a
        request's is (planned, cached by piece, encoded by the worker thread and the child
        process), so its first-time costs are paid before any request. Logs
        ``tokenizer.warmed`` with the time it took."""
        text = warm_text(int(tokens * warmup.CHARS_PER_TOKEN))
        prompt = ChatPrompt(messages=({"role": "user", "content": text},))
        started = time.perf_counter()
        step = self._begin(model, prompt, 0)
        if not isinstance(step, TokenCount):
            encoder = step.plan.vocab.encoder
            if self._executor is None:
                found = encoder.count_many(step.texts)
            else:
                found = self._executor.submit(encoder.count_many, step.texts).result()
            step = self._end(step, found)
        log.info(
            "tokenizer.warmed",
            model=model,
            tokens=step.tokens,
            warm_ms=round((time.perf_counter() - started) * 1000, 1),
        )
        return step

    @classmethod
    def for_models(
        cls, models: Sequence[Mapping[str, Any]], metrics: Metrics | None = None, **counting: Any
    ) -> TokenCounter:
        """A counter for these models alone, spelt as the config's ``models`` (and ``counting``)
        are, with no gateway policy around them: for the simulator, tools and tests."""
        policy = parse_settings(
            {
                "models": list(models),
                "counting": counting,
                # Settings demand a cluster and a lane; a counter reads neither.
                "clusters": [{"name": "none", "endpoints": ["http://127.0.0.1:1"]}],
                "lanes": [
                    {
                        "name": "all",
                        "max_prompt_tokens": 10**9,
                        "clusters": ["none"],
                        "slots": {"lane": 1, "per_endpoint": 1},
                    }
                ],
            },
            environ={},
        )
        return cls.from_settings(policy, metrics)

    async def count(self, model: str, prompt: Prompt, *, exact_above: int) -> TokenCount:
        """Tokens the engine will see; large exact counts run off the event loop."""
        step = self._begin(model, prompt, exact_above)
        return step if isinstance(step, TokenCount) else await self.finish(step)

    def start_exact(self, count: TokenCount) -> TokenCount | Unfinished:
        """The exact count of ``count`` when it can be had inline, else what is left once the
        cache was looked up (from the plan the bound kept: a cached piece costs one hash):
        ``finish`` encodes only those pieces (no second lookup, no second plan)."""
        step = self._looked_up(count)
        if isinstance(step, TokenCount):
            return step
        found = self._inline(step.plan, step.texts)
        return step if found is None else self._end(step, found)

    def _looked_up(self, count: TokenCount) -> TokenCount | Unfinished:
        """``count`` once exact already, else counted whole when small, else its pieces looked
        up in the cache: the exact count, or the pieces that still need encoding."""
        plan = count.plan
        if count.method != "bound" or not isinstance(plan, Plan):
            return count
        direct = self._direct(plan)
        if direct is not None:
            return direct
        return self._resume(plan, time.perf_counter())

    def _direct(self, plan: Plan) -> TokenCount | None:
        """A small prompt counted whole, past the cache (None when large or the encoder busy).
        Piece counts add up to the whole (special tokens split before any BPE), so it is the
        same count the cache would assemble."""
        if plan.prompt_bytes > DIRECT_MAX_BYTES:
            return None
        if self._executor is not None and plan.vocab.encoder.out_of_process:
            return None  # never inline (see _inline): no use joining the pieces
        found = self._inline(plan, ["".join(plan.pieces[a:b]) for a, b in plan.sequences])
        if found is None:
            return None
        # Not in shapegate_count_seconds, which times counts on the request's path: this one
        # overlaps the engine's work.
        sizes = [n + plan.extra for n in found]
        return TokenCount(
            int(sum(sizes)), "exact", plan.vocab.id, plan.prompt_bytes, 0.0, largest=_many(sizes)
        )

    async def finish(self, step: Unfinished) -> TokenCount:
        """The count ``start_exact`` left unfinished: its missing pieces encoded in the worker."""
        found = self._inline(step.plan, step.texts)
        if found is None:
            loop = asyncio.get_running_loop()
            encoder = step.plan.vocab.encoder
            found = await loop.run_in_executor(self._executor, encoder.count_many, step.texts)
        return self._end(step, found)

    def _inline(self, plan: Plan, texts: list[str]) -> list[int] | None:
        """Counts of ``texts``, encoded on this thread when that is allowed and cheap."""
        encoder = plan.vocab.encoder
        if self._executor is None:
            return encoder.count_many(texts)
        # Never a pipe round trip to the bounded child (tokenizers/worker.py) on the event loop:
        # that count goes to the worker thread, which waits on the pipe without the GIL.
        if not encoder.out_of_process and sum(len(text) for text in texts) <= INLINE_MAX_CHARS:
            return encoder.try_count_many(texts)  # None while a worker holds it
        return None

    def count_sync(self, model: str, prompt: Prompt, *, exact_above: int = 0) -> TokenCount:
        """Same answer as ``count``, computed inline."""
        step = self._begin(model, prompt, exact_above)
        if isinstance(step, TokenCount):
            return step
        return self._end(step, step.plan.vocab.encoder.count_many(step.texts))

    def encode(self, model: str, text: str) -> list[int]:
        """Token ids of plain text: no template, nothing added; special-token strings match."""
        return self._model(model).vocab.encoder.encode(text)

    def prompt_ids(self, model: str, prompt: Prompt) -> Sequence[int]:
        """The prompt's token ids as the engine gets them: a chat prompt rendered with the
        model's template, a completions prompt's first text (or its token ids as sent). The
        text is cut in the count's pieces (``plan.py``: before each message's special token,
        where no BPE merge crosses, so the pieces' ids joined are the whole text's ids) and
        each piece's ids are kept in a bounded cache: a repeated system prompt or document is
        encoded once, not on every request (the prefix index's exact hashes)."""
        if isinstance(prompt, CompletionPrompt):
            if prompt.token_ids:
                return prompt.token_ids[0]
            if not prompt.texts:
                return []
            prompt = CompletionPrompt(texts=prompt.texts[:1])
        entry = self._model(model)
        plan = plan_prompt(entry, prompt, exact_above=0)
        if plan is None:
            return []
        start, end = plan.sequences[0]
        encoder = entry.vocab.encoder
        ids: array[int] = array("I")
        for piece, data in zip(plan.pieces[start:end], plan.encoded[start:end], strict=True):
            digest = cache.key(entry.vocab.id, piece.encode("utf-8") if data is None else data)
            found = self._ids.get(digest)
            if found is None:
                found = array("I", encoder.encode(piece))
                self._ids.put(digest, found)
            ids.extend(found)
        return ids

    def decode(self, model: str, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens included); ValueError for an unknown id."""
        return self._model(model).vocab.encoder.decode(ids)

    def render_chat(self, model: str, prompt: ChatPrompt) -> str:
        """The prompt text the engine sees (template applied, generation prompt added)."""
        return "".join(chat_pieces(self._model(model), prompt))

    def tokenizer_id(self, model: str) -> str:
        return self._model(model).vocab.id

    def template_of(self, model: str) -> str:
        """The chat template mode in use for ``model`` (``auto`` resolved)."""
        return self._model(model).chat_template

    def template_warnings(self, settings: Settings) -> list[str]:
        """Every model whose policy renders another chat template than the one its tokenizer
        ships, which is the one vLLM renders: its chat counts will not be the engine's."""
        warnings = []
        for model in settings.models:
            entry = self._models.get(model.name)
            if entry is None or entry.vocab.chat_template is None or entry.chat_template == "hf":
                continue
            warnings.append(
                f"model {model.name!r} renders chat prompts with chat_template "
                f"{entry.chat_template!r}, but its tokenizer ships its own chat template, the "
                "one vLLM renders: chat counts will differ from the engine's (for Qwen3.6, 2 "
                "tokens on a plain chat, ~200 with tools); set chat_template: hf"
            )
        return warnings

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        for encoder in {
            id(m.vocab.encoder): m.vocab.encoder for m in self._models.values()
        }.values():
            encoder.close()

    # -- internals ---------------------------------------------------------------------------

    def _model(self, name: str) -> Model:
        entry = self._models.get(name)
        if entry is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return entry

    def _answer(self, plan: Plan | None, prompt: Prompt, started: float) -> TokenCount:
        """The count that needs no tokenizer: the bound, or the length of token-id prompts."""
        if plan is not None:
            largest = plan.largest_bound if len(plan.sequences) > 1 else None
            return self._done(
                plan.bound, "bound", plan.vocab.id, plan.prompt_bytes, started, plan, largest
            )
        assert isinstance(prompt, CompletionPrompt)
        sizes = [len(ids) for ids in prompt.token_ids]
        return self._done(sum(sizes), "exact", "token_ids", 0, started, largest=_many(sizes))

    def _begin(self, model: str, prompt: Prompt, exact_above: int) -> TokenCount | Unfinished:
        """The answer when no piece needs encoding (bound, token ids, all cached), else what to
        encode; ``count`` and ``count_sync`` differ only in where the encoding runs."""
        started = time.perf_counter()
        plan = plan_prompt(self._model(model), prompt, exact_above)
        if plan is None or plan.bound < exact_above:
            return self._answer(plan, prompt, started)
        return self._resume(plan, started)

    def _resume(self, plan: Plan, started: float) -> TokenCount | Unfinished:
        """A plan's answer from the cache, else what is left to encode."""
        whole = self._whole_keys(plan)
        if whole is not None:
            sizes = [self._cache.get(k) for k in whole]
            if None not in sizes:
                totals = [n + plan.extra for n in sizes if n is not None]
                return self._done(
                    sum(totals),
                    "cache",
                    plan.vocab.id,
                    plan.prompt_bytes,
                    started,
                    largest=_many(totals),
                )
        counts, misses, keys = self._lookup(plan)
        if not misses:
            self._store_whole(plan, counts, whole)
            return self._total(plan, counts, "cache", started)
        texts = [plan.pieces[i] for i in misses]
        return Unfinished(plan, counts, misses, keys, texts, started, whole)

    def _whole_keys(self, plan: Plan) -> list[bytes] | None:
        """A small prompt's cache keys, one a sequence (its pieces joined): one hash where the
        pieces take one each. A sequence's text counts what its pieces add up to (special
        tokens split before any BPE), so it is a piece entry like any other, in the same
        bounded cache. None when caching is off, the prompt is large (a miss would hash it
        twice) or every sequence is one piece (its key is that piece's)."""
        if (
            self._cache.max_entries <= 0
            or plan.prompt_bytes > DIRECT_MAX_BYTES
            or len(plan.pieces) == len(plan.sequences)
        ):
            return None
        vocab_id, pieces = plan.vocab.id, plan.pieces
        return [
            cache.key(vocab_id, "".join(pieces[a:b]).encode("utf-8")) for a, b in plan.sequences
        ]

    def _store_whole(self, plan: Plan, counts: list[int | None], whole: list[bytes] | None) -> None:
        if whole is not None:
            for digest, (a, b) in zip(whole, plan.sequences, strict=True):
                self._cache.put(digest, sum(counts[i] or 0 for i in range(a, b)))

    def _end(self, step: Unfinished, found: list[int]) -> TokenCount:
        self._store(step.counts, step.misses, step.keys, found)
        self._store_whole(step.plan, step.counts, step.whole)
        return self._total(step.plan, step.counts, "exact", step.started)

    def _lookup(self, plan: Plan) -> tuple[list[int | None], list[int], list[bytes]]:
        """Cached counts by piece (None where missing), the missing indexes, the cache keys."""
        keys = [
            cache.key(plan.vocab.id, piece.encode("utf-8") if data is None else data)
            for piece, data in zip(plan.pieces, plan.encoded, strict=True)
        ]
        counts = [self._cache.get(k) for k in keys]
        return counts, [i for i, n in enumerate(counts) if n is None], keys

    def _store(
        self, counts: list[int | None], misses: list[int], keys: list[bytes], found: list[int]
    ) -> None:
        for i, n in zip(misses, found, strict=True):
            counts[i] = n
            self._cache.put(keys[i], n)

    def _total(
        self, plan: Plan, counts: list[int | None], method: Method, started: float
    ) -> TokenCount:
        sizes = [sum(counts[i] or 0 for i in range(a, b)) + plan.extra for a, b in plan.sequences]
        return self._done(
            sum(sizes), method, plan.vocab.id, plan.prompt_bytes, started, largest=_many(sizes)
        )

    def _done(
        self,
        tokens: int,
        method: Method,
        tokenizer: str,
        prompt_bytes: int,
        started: float,
        plan: Plan | None = None,
        largest: int | None = None,
    ) -> TokenCount:
        seconds = time.perf_counter() - started
        if self._metrics is not None:
            self._metrics.child(self._metrics.count_seconds, method).observe(seconds)
        return TokenCount(int(tokens), method, tokenizer, prompt_bytes, seconds, plan, largest)


def _many(sizes: list[int]) -> int | None:
    """A batch's largest sequence; None for a single one (its count is its size)."""
    return int(max(sizes)) if len(sizes) > 1 else None
