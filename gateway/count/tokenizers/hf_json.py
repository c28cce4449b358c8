"""A Hugging Face ``tokenizer.json`` (a file, a model folder, or a .zip holding it) as a
``Vocabulary``: its added tokens, whether the free bound is sound for it, what its
post-processor adds, and the chat template that ships beside it (``tokenizer_config.json``,
``chat_template.jinja``). ``backend: auto`` tries gigatoken, then tiktoken when the file is
byte-level BPE tiktoken counts exactly (``byte_level.py``), then Hugging Face ``tokenizers``.
"""

from __future__ import annotations

import functools
import json
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gateway.count.tokenizers.backends import (
    BackendUnavailable,
    EncoderLimits,
    first_that_loads,
    in_child,
    require_gigatoken,
)
from gateway.count.tokenizers.byte_level import tiktoken_eligibility, tiktoken_from_json
from gateway.count.tokenizers.child import gigatoken_from_json
from gateway.count.tokenizers.encoders import Backend, Encoder, HFEncoder
from gateway.count.tokenizers.vocab import Vocabulary, split_token
from gateway.settings import ConfigError, TokenizerSettings

# Pre-tokenizers that only cut the text (never add bytes), for the bound's soundness.
_CUTTING_PRETOKENIZERS = frozenset(
    {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "ByteLevel", "Sequence"}
)


def read_tokenizer_json(path: Path) -> tuple[bytes, Path]:
    """The tokenizer.json bytes (from a file, a folder, or a .zip holding it) and its folder."""
    if path.is_dir():
        for candidate in ("tokenizer.json", "tokenizer.json.zip"):
            if (path / candidate).is_file():
                return read_tokenizer_json(path / candidate)
        raise ConfigError(f"tokenizer folder {path} holds no tokenizer.json")
    try:
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                return archive.read("tokenizer.json"), path.parent
        return path.read_bytes(), path.parent
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"cannot read tokenizer file {path}: {exc}") from exc


def _template_files(folder: Path) -> tuple[str | None, dict[str, str]]:
    """A Hugging Face model folder's chat template and the special tokens it refers to."""
    template: str | None = None
    variables: dict[str, str] = {}
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {config_path}: {exc}") from exc
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                variables[key] = value
        raw = config.get("chat_template")
        if isinstance(raw, list):  # named templates: [{"name": "default", "template": ...}]
            raw = next((t.get("template") for t in raw if t.get("name") == "default"), None)
        template = raw if isinstance(raw, str) else None
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        template = jinja_path.read_text(encoding="utf-8")
    return template, variables


_HEADER_KEYS = frozenset({"added_tokens", "normalizer", "pre_tokenizer", "post_processor"})


def _json_header(text: str) -> dict[str, Any]:
    """A tokenizer.json without its vocabulary and merges.

    Parsing those would build ~500k Python objects (~100 MB, much of it kept by the allocator
    after it is freed) only to read a few settings. Hugging Face writes ``model`` last and starts
    it with its scalar settings, so reading member by member stops early; a file laid out any
    other way is parsed in full.
    """
    header, key, at = _members(text, 0, lambda key, seen: key == "model" and seen >= _HEADER_KEYS)
    if key is None:
        return header
    header["model"], _, _ = _members(text, at, lambda key, seen: key in ("vocab", "merges"))
    return header


def _members(
    text: str, at: int, stop: Callable[[str, set[str]], bool]
) -> tuple[dict[str, Any], str | None, int]:
    """Members of the JSON object at ``at`` up to the first key ``stop`` accepts.

    Returns (members read, the key it stopped at or None at the object's end, where that key's
    value starts). Raises ValueError on malformed JSON.
    """
    decoder = json.JSONDecoder()

    def skip(i: int, expected: str | None = None) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if expected is not None:
            if i >= len(text) or text[i] != expected:
                raise ValueError(f"expected {expected!r} at offset {i}")
            i = skip(i + 1)
        return i

    out: dict[str, Any] = {}
    at = skip(at, "{")
    while at < len(text) and text[at] != "}":
        key, at = decoder.raw_decode(text, at)
        at = skip(at, ":")
        if stop(key, set(out)):
            return out, key, at
        out[key], at = decoder.raw_decode(text, at)
        at = skip(at)
        if at < len(text) and text[at] == ",":
            at = skip(at + 1)
    return out, None, at


def _bound_sound(config: Mapping[str, Any]) -> tuple[bool, bool]:
    """(bound is sound, text is NFC-normalised) for a parsed tokenizer.json."""
    model = config.get("model") or {}
    normalizer = config.get("normalizer")
    nfc = isinstance(normalizer, dict) and normalizer.get("type") == "NFC"
    if model.get("type") != "BPE" or not (normalizer is None or nfc):
        return False, nfc

    def cuts_only(node: Any) -> bool:
        if node is None:
            return True
        if node.get("type") not in _CUTTING_PRETOKENIZERS or node.get("add_prefix_space"):
            return False
        return all(cuts_only(child) for child in node.get("pretokenizers", ()))

    return cuts_only(config.get("pre_tokenizer")), nfc


def _post_processor_tokens(node: Any) -> int:
    """Tokens a tokenizer.json post-processor adds around one sequence (BOS/EOS)."""
    if not isinstance(node, dict):
        return 0
    kind = node.get("type")
    if kind == "TemplateProcessing":
        return sum(1 for item in node.get("single", ()) if "SpecialToken" in item)
    if kind in ("BertProcessing", "RobertaProcessing"):
        return 2
    if kind == "Sequence":
        return sum(_post_processor_tokens(child) for child in node.get("processors", ()))
    return 0


def from_hf_json(
    name: str,
    path: Path,
    settings: TokenizerSettings,
    on_fallback: Callable[[str, BaseException, str], None] | None,
    limits: EncoderLimits,
) -> Vocabulary:
    data, folder = read_tokenizer_json(path)
    try:
        config = _json_header(data.decode("utf-8"))
    except ValueError as exc:
        raise ConfigError(f"tokenizer file {path} is not valid JSON: {exc}") from exc
    try:
        sound, nfc = _bound_sound(config)
        specials = frozenset(
            str(t["content"]) for t in config.get("added_tokens") or () if not t.get("normalized")
        )
        extra = _post_processor_tokens(config.get("post_processor"))
    except (AttributeError, TypeError, KeyError) as exc:
        raise ConfigError(f"tokenizer file {path} is not a tokenizer.json: {exc!r}") from exc
    template, variables = _template_files(folder)

    def gigatoken() -> Encoder:
        require_gigatoken()
        return in_child(functools.partial(gigatoken_from_json, data), "gigatoken", limits)

    def tiktoken_() -> Encoder:
        reason = tiktoken_eligibility(config)
        if reason is not None:  # a property of the file, not a failure: no error counted
            raise BackendUnavailable(f"tiktoken cannot count this tokenizer.json exactly: {reason}")
        return in_child(functools.partial(tiktoken_from_json, data), "tiktoken", limits)

    def hf() -> Encoder:
        import tokenizers

        return HFEncoder(tokenizers.Tokenizer.from_str(data.decode("utf-8")))

    order: dict[str, list[tuple[Backend, Callable[[], Encoder]]]] = {
        "auto": [("gigatoken", gigatoken), ("tiktoken", tiktoken_), ("hf", hf)],
        "gigatoken": [("gigatoken", gigatoken)],
        "tiktoken": [("tiktoken", tiktoken_)],
        "hf": [("hf", hf)],
    }
    encoder, fallback = first_that_loads(order[settings.backend], path, on_fallback)
    return Vocabulary(
        name=name,
        encoder=encoder,
        specials=specials,
        nfc=nfc,
        bound_sound=sound,
        completion_extra=extra,
        chat_template=template,
        template_vars=variables,
        origin=str(path),
        fallback=fallback,
        split_token=split_token(specials),
    )
