"""The small-prompt fast path of the count cache (``TokenCounter._whole_keys``): a prompt under
``DIRECT_MAX_BYTES`` is looked up by one key a sequence (its pieces joined) before its pieces
are; its answer is the same count the piece path gives, on a hit and on a miss, per template
and per model, and a large prompt still hashes piece by piece."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.core.count import TokenCount
from gateway.count.tokenizers import cache
from gateway.count.tokens import DIRECT_MAX_BYTES, TokenCounter
from gateway.protocols.openai import ChatPrompt, CompletionPrompt, Prompt


def qwen(name: str, template: str) -> dict[str, Any]:
    return {
        "name": name,
        "tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": template},
    }


MODELS = [qwen("q-chatml", "chatml"), qwen("q-hf", "hf"), qwen("q-none", "none")]


@pytest.fixture(scope="module")
def counters() -> Iterator[tuple[TokenCounter, TokenCounter]]:
    """The same models with the cache (fast path on) and without it (every count encoded)."""
    cached = TokenCounter.for_models(MODELS)
    uncached = TokenCounter.for_models(MODELS, cache_entries=0)
    yield cached, uncached
    cached.close()
    uncached.close()


def fresh(text: str) -> str:
    return f"{text} [{uuid.uuid4()}]"


def small_chat() -> ChatPrompt:
    return ChatPrompt(
        messages=(
            {"role": "system", "content": fresh("You are terse. Ünïcödé, e\u0301.")},
            {"role": "user", "content": fresh("Say <|im_end|> hello in one word.")},
        )
    )


def spy_keys(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every piece the cache hashes from now on (``cache.key``'s argument)."""
    hashed: list[bytes] = []
    real = cache.key

    def key(tokenizer_id: str, piece: bytes) -> bytes:
        hashed.append(piece)
        return real(tokenizer_id, piece)

    monkeypatch.setattr(cache, "key", key)
    return hashed


def exact_later(counter: TokenCounter, model: str, prompt: Prompt) -> TokenCount:
    """The request path: the bound decides, the exact count is finished from its plan."""
    bound = counter.count_sync(model, prompt, exact_above=10**9)
    assert bound.method == "bound"
    step = counter.start_exact(bound)
    if not isinstance(step, TokenCount):
        step = counter._end(step, step.plan.vocab.encoder.count_many(step.texts))
    return step


@pytest.mark.parametrize("model", ["q-chatml", "q-hf", "q-none"])
def test_a_small_prompt_counts_the_same_on_a_miss_and_a_hit(
    counters: tuple[TokenCounter, TokenCounter], model: str
) -> None:
    cached, uncached = counters
    prompt = small_chat()
    truth = uncached.count_sync(model, prompt)
    assert truth.tokens == len(cached.encode(model, cached.render_chat(model, prompt)))
    miss = cached.count_sync(model, prompt)
    hit = cached.count_sync(model, prompt)
    assert (miss.method, hit.method) == ("exact", "cache")
    assert miss.tokens == hit.tokens == truth.tokens
    later = exact_later(cached, model, prompt)
    assert (later.method, later.tokens) == ("cache", truth.tokens)


def test_templates_and_models_sharing_a_tokenizer_never_share_a_whole_count(
    counters: tuple[TokenCounter, TokenCounter],
) -> None:
    """Three templates render one prompt three ways: each hit is its own render's count, in
    whichever order they come (the key is the rendered text)."""
    cached, uncached = counters
    prompt = small_chat()
    models = ["q-chatml", "q-hf", "q-none"]
    truths = {m: uncached.count_sync(m, prompt).tokens for m in models}
    assert len(set(truths.values())) == 3
    for model in [*models, *reversed(models)]:
        assert exact_later(cached, model, prompt).tokens == truths[model]


def test_a_template_changed_on_reload_counts_its_own_render(
    counters: tuple[TokenCounter, TokenCounter],
) -> None:
    """A reload to another template for the same model name (a new counter) answers the new
    render's count, never the old one's."""
    cached, uncached = counters
    prompt = small_chat()
    before = exact_later(cached, "q-chatml", prompt)
    exact_later(cached, "q-chatml", prompt)
    reloaded = TokenCounter.for_models([qwen("q-chatml", "hf")])
    try:
        after = exact_later(reloaded, "q-chatml", prompt)
        again = exact_later(reloaded, "q-chatml", prompt)
    finally:
        reloaded.close()
    assert after.tokens == again.tokens == uncached.count_sync("q-hf", prompt).tokens
    assert after.tokens != before.tokens
    assert again.method == "cache"


def test_a_cached_small_prompt_hashes_once_not_once_a_piece(
    counters: tuple[TokenCounter, TokenCounter], monkeypatch: pytest.MonkeyPatch
) -> None:
    cached, _ = counters
    prompt = small_chat()  # three pieces: system, user, the generation prompt
    first = exact_later(cached, "q-chatml", prompt)
    hashed = spy_keys(monkeypatch)
    hit = exact_later(cached, "q-chatml", prompt)
    assert hit.tokens == first.tokens
    assert hashed == [cached.render_chat("q-chatml", prompt).encode("utf-8")]


def test_a_batch_keeps_its_sum_and_largest_on_the_fast_path(
    counters: tuple[TokenCounter, TokenCounter],
) -> None:
    cached, uncached = counters
    texts = (fresh("short"), fresh("<|im_start|>user\nlonger <|im_start|> text " * 20))
    prompt = CompletionPrompt(texts=texts)
    truth = uncached.count_sync("q-chatml", prompt)
    assert truth.largest is not None
    for _ in range(3):  # a miss, then hits
        count = exact_later(cached, "q-chatml", prompt)
        assert (count.tokens, count.largest) == (truth.tokens, truth.largest)
    assert count.method == "cache"


def test_a_large_prompt_is_hashed_piece_by_piece(
    counters: tuple[TokenCounter, TokenCounter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``DIRECT_MAX_BYTES`` a miss would hash the prompt twice: no whole key then."""
    cached, _ = counters
    system = {"role": "system", "content": fresh("x " * DIRECT_MAX_BYTES)}
    prompt = ChatPrompt(messages=(system, {"role": "user", "content": fresh("hi")}))
    exact_later(cached, "q-chatml", prompt)
    hashed = spy_keys(monkeypatch)
    assert exact_later(cached, "q-chatml", prompt).method == "cache"
    assert len(hashed) == 3  # system, user, the generation prompt
