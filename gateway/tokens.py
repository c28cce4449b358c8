"""How many prompt tokens will the engine see? The model's own vocabulary and chat template decide.

Contract:
- ``TokenCounter.from_settings(settings)`` loads and warms every model's tokenizer at start-up
  (never from the network) and logs ``tokenizer.loaded`` once a model, with the backend in use
  and any fallback; a file that fails to load is a ``ConfigError`` naming the model and the file.
- ``count(model, prompt, exact_above=N)`` answers in one of three ways (``TokenCount.method``):
  1. ``bound``: UTF-8 bytes of everything the template renders (of its NFC form where the
     tokenizer normalises). A byte-level BPE never emits more tokens than bytes, and each special
     token is one token for many bytes, so this is an upper bound (property-tested). Below
     ``exact_above`` it decides the route and no tokenizer runs.
  2. ``cache``: every piece of the prompt was counted before. A rendered prompt is cut before each
     ``<|im_start|>`` (one piece a ChatML message); special tokens are split out before any BPE
     runs, so piece counts add up exactly to the whole (tested against the full render). The LRU
     is keyed by SHA-256 of (tokenizer, piece): an agent's system prompt and earlier turns are
     counted once.
  3. ``exact``: the missing pieces are encoded. Small ones inline; large ones in a worker thread
     with gigatoken's GIL-free batch call, so a 300k-token count leaves the event loop running
     (with the GIL held it would stall the loop for the whole count).
- Chat prompts: ``chat_template: chatml`` renders the built-in ChatML (``tokenizers/templates.py``
  lists what it renders and where it differs from Qwen3.6's own template), ``hf`` renders the
  model's Jinja template, ``none`` counts the message texts joined by newlines.
- Special-token strings inside messages (``<|im_end|>`` in user text) count as the special token:
  vLLM renders the template and tokenizes the result with Hugging Face semantics, which match
  added tokens anywhere in the text.
- Completions: each prompt counts its text plus what the tokenizer's post-processor adds (a BOS;
  none for Qwen); token-id prompts count as they are. For a batch of prompts the count is the
  LARGEST single prompt: each is its own sequence in the engine, and the lane protects against
  one long prefill, not against the sum. ``prompt_bytes`` covers all of them. Token-id prompts
  answer ``method="exact"`` with ``tokenizer="token_ids"`` (no tokenizer ran).
- Counts are Python ints. A template that rejects the messages raises ``BadRequest`` (the engine
  would answer 400); an unknown model raises ``ModelNotFound``.
"""

from __future__ import annotations

import asyncio
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from jinja2 import TemplateError

from gateway.errors import BadRequest, ModelNotFound
from gateway.log import Logger, get_logger, swallowed
from gateway.metrics import Metrics
from gateway.protocol import ChatPrompt, CompletionPrompt, Prompt
from gateway.settings import ConfigError, CountingSettings, Settings
from gateway.tokenizers import cache
from gateway.tokenizers.encoders import GIL_FREE_ABOVE_CHARS
from gateway.tokenizers.templates import (
    ChatTemplate,
    TemplateRejected,
    chatml_pieces,
    plain_text,
    split_before,
)
from gateway.tokenizers.vocab import Vocabulary, load_vocabulary

# "none": nothing to count (a multipart audio request); its lane is named by the policy.
Method = Literal["bound", "cache", "exact", "none"]
# Misses up to this many characters are counted on the event loop (under ~2 ms with the GIL
# held either way); longer ones go to the worker thread, where gigatoken releases the GIL.
INLINE_MAX_CHARS = GIL_FREE_ABOVE_CHARS


@dataclass(frozen=True, slots=True)
class TokenCount:
    tokens: int
    method: Method
    tokenizer: str
    prompt_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _Model:
    vocab: Vocabulary
    chat_template: Literal["chatml", "hf", "none"]
    template: ChatTemplate | None


@dataclass(frozen=True, slots=True)
class _Plan:
    """A prompt cut into pieces: ``sequences`` are [start, end) ranges of ``pieces``."""

    vocab: Vocabulary
    pieces: tuple[str, ...]
    encoded: tuple[bytes | None, ...]  # UTF-8 of the non-ASCII pieces, kept for the cache key
    sequences: tuple[tuple[int, int], ...]
    extra: int
    bound: int
    prompt_bytes: int


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest("prompt text holds a lone surrogate: not valid Unicode") from exc


def _nfc_len(text: str, raw: int) -> int:
    """UTF-8 bytes of the NFC form: what an NFC-normalising tokenizer actually encodes."""
    if text.isascii() or unicodedata.is_normalized("NFC", text):
        return raw
    return len(unicodedata.normalize("NFC", text).encode("utf-8"))


class TokenCounter:
    def __init__(
        self,
        models: Mapping[str, _Model],
        counting: CountingSettings,
        metrics: Metrics | None = None,
    ) -> None:
        self._models = dict(models)
        self._cache = cache.CountCache(counting.cache_entries)
        self._metrics = metrics
        self._executor = (
            ThreadPoolExecutor(max_workers=counting.exact_workers, thread_name_prefix="count")
            if counting.exact_executor == "thread"
            else None
        )

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> TokenCounter:
        log = get_logger("tokens")
        loaded: dict[str, Vocabulary] = {}
        models: dict[str, _Model] = {}
        for model in settings.models:
            spec = model.tokenizer
            started = time.perf_counter()
            # Models sharing a vocabulary share one loaded tokenizer (~120 MB for Qwen's).
            shared = spec.model_dump_json(exclude={"chat_template"})
            vocab = loaded.get(shared)
            if vocab is None:
                try:
                    vocab = load_vocabulary(spec, _fallback_logger(log, metrics, model.name))
                except ConfigError as exc:
                    raise ConfigError(f"model {model.name!r}: {exc}") from exc
                loaded[shared] = vocab
            template = None
            if spec.chat_template == "hf":
                if vocab.chat_template is None:
                    raise ConfigError(
                        f"model {model.name!r}: chat_template hf, but no chat "
                        f"template ships beside {vocab.origin}"
                    )
                try:
                    template = ChatTemplate(vocab.chat_template, vocab.template_vars)
                except TemplateError as exc:
                    raise ConfigError(
                        f"model {model.name!r}: the chat template beside "
                        f"{vocab.origin} does not compile: {exc}"
                    ) from exc
            entry = _Model(vocab, spec.chat_template, template)
            for name in (model.name, *model.aliases):
                models[name] = entry
            log.info(
                "tokenizer.loaded",
                model=model.name,
                tokenizer=vocab.id,
                backend=vocab.encoder.backend,
                fallback=vocab.fallback,
                origin=vocab.origin,
                chat_template=spec.chat_template,
                bound="sound" if vocab.bound_sound else "disabled",
                piece_cache=vocab.split_token is not None,
                load_ms=round((time.perf_counter() - started) * 1000, 1),
            )
        return cls(models, settings.counting, metrics)

    async def count(self, model: str, prompt: Prompt, *, exact_above: int) -> TokenCount:
        """Tokens the engine will see; large exact counts run off the event loop."""
        started = time.perf_counter()
        plan = self._plan(model, prompt, exact_above)
        if plan is None or plan.bound < exact_above:
            return self._answer(plan, prompt, started)
        counts, misses, keys = self._lookup(plan)
        if misses:
            texts = [plan.pieces[i] for i in misses]
            found = None
            if self._executor is None:
                found = plan.vocab.encoder.count_many(texts)
            elif sum(len(text) for text in texts) <= INLINE_MAX_CHARS:
                found = plan.vocab.encoder.try_count_many(texts)  # None while a worker holds it
            if found is None:
                loop = asyncio.get_running_loop()
                found = await loop.run_in_executor(
                    self._executor, plan.vocab.encoder.count_many, texts
                )
            self._store(counts, misses, keys, found)
        return self._total(plan, counts, "exact" if misses else "cache", started)

    def count_sync(self, model: str, prompt: Prompt, *, exact_above: int = 0) -> TokenCount:
        """Same answer as ``count``, computed inline."""
        started = time.perf_counter()
        plan = self._plan(model, prompt, exact_above)
        if plan is None or plan.bound < exact_above:
            return self._answer(plan, prompt, started)
        counts, misses, keys = self._lookup(plan)
        if misses:
            found = plan.vocab.encoder.count_many([plan.pieces[i] for i in misses])
            self._store(counts, misses, keys, found)
        return self._total(plan, counts, "exact" if misses else "cache", started)

    def encode(self, model: str, text: str) -> list[int]:
        """Token ids of plain text: no template, nothing added; special-token strings match."""
        return self._model(model).vocab.encoder.encode(text)

    def decode(self, model: str, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens included); ValueError for an unknown id."""
        return self._model(model).vocab.encoder.decode(ids)

    def render_chat(self, model: str, prompt: ChatPrompt) -> str:
        """The prompt text the engine sees (template applied, generation prompt added)."""
        return "".join(self._chat_pieces(self._model(model), prompt))

    def tokenizer_id(self, model: str) -> str:
        return self._model(model).vocab.id

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------

    def _model(self, name: str) -> _Model:
        entry = self._models.get(name)
        if entry is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return entry

    def _chat_pieces(self, entry: _Model, prompt: ChatPrompt) -> list[str]:
        if entry.template is not None:
            try:
                return [entry.template.render(prompt)]
            except TemplateRejected as exc:
                raise BadRequest(str(exc), param="messages") from exc
        if entry.chat_template == "none":
            return [plain_text(prompt)]
        return chatml_pieces(prompt)

    def _plan(self, model: str, prompt: Prompt, exact_above: int) -> _Plan | None:
        """The prompt as pieces to count, with its free bound; None for token-id prompts.

        ``bound`` is sound whenever it is below ``exact_above`` (the only case it is used): the
        NFC check, a full scan of the text, runs only then, on a text that is small by then.
        """
        entry = self._model(model)
        vocab = entry.vocab
        texts: Sequence[str]
        if isinstance(prompt, CompletionPrompt):
            if not prompt.texts:
                return None
            texts, extra = prompt.texts, vocab.completion_extra
        else:
            texts, extra = [], 0
        pieces: list[str] = []
        sequences: list[tuple[int, int]] = []
        if isinstance(prompt, ChatPrompt):
            chat = self._chat_pieces(entry, prompt)
            if len(chat) == 1 or vocab.split_token is None:
                # A rendered template or plain text is cut here; ChatML comes cut by message.
                chat = split_before("".join(chat), vocab.split_token)
            pieces.extend(chat)
            sequences.append((0, len(pieces)))
        for text in texts:
            start = len(pieces)
            pieces.extend(split_before(text, vocab.split_token))
            sequences.append((start, len(pieces)))
        # ASCII (the common case) needs no encoding to know its size: isascii() is O(1).
        encoded = [None if piece.isascii() else _utf8(piece) for piece in pieces]
        raw = [
            len(piece) if data is None else len(data)
            for piece, data in zip(pieces, encoded, strict=True)
        ]

        def bound_of(sizes: list[int]) -> int:
            return max((sum(sizes[a:b]) + extra for a, b in sequences), default=0)

        bound = bound_of(raw)
        if not vocab.bound_sound:
            bound = 2**62  # no provable bound: every count is exact
        elif vocab.nfc and bound < exact_above:
            bound = bound_of([_nfc_len(piece, n) for piece, n in zip(pieces, raw, strict=True)])
        return _Plan(vocab, tuple(pieces), tuple(encoded), tuple(sequences), extra, bound, sum(raw))

    def _answer(self, plan: _Plan | None, prompt: Prompt, started: float) -> TokenCount:
        """The count that needs no tokenizer: the bound, or the length of token-id prompts."""
        if plan is not None:
            return self._done(plan.bound, "bound", plan.vocab.id, plan.prompt_bytes, started)
        assert isinstance(prompt, CompletionPrompt)
        tokens = max((len(ids) for ids in prompt.token_ids), default=0)
        return self._done(tokens, "exact", "token_ids", 0, started)

    def _lookup(self, plan: _Plan) -> tuple[list[int | None], list[int], list[bytes]]:
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
        self, plan: _Plan, counts: list[int | None], method: Method, started: float
    ) -> TokenCount:
        tokens = max(
            sum(counts[i] or 0 for i in range(a, b)) + plan.extra for a, b in plan.sequences
        )
        return self._done(tokens, method, plan.vocab.id, plan.prompt_bytes, started)

    def _done(
        self, tokens: int, method: Method, tokenizer: str, prompt_bytes: int, started: float
    ) -> TokenCount:
        seconds = time.perf_counter() - started
        if self._metrics is not None:
            self._metrics.count_seconds.labels(method=method).observe(seconds)
        return TokenCount(int(tokens), method, tokenizer, prompt_bytes, seconds)


def _fallback_logger(
    log: Logger,
    metrics: Metrics | None,
    model: str,
) -> Callable[[str, BaseException, str], None]:
    def record(backend: str, exc: BaseException, decision: str) -> None:
        swallowed(log, metrics, "tokenizer.load", exc, decision, model=model, backend=backend)

    return record
