"""Load a model's vocabulary from its ``TokenizerSettings``: shipped or local files, no network.

Contract: ``load_vocabulary(settings)`` returns a warmed ``Vocabulary`` (the first encode of a
gigatoken tokenizer costs ~100x a later one, so it is paid here, at start-up) or raises
``ConfigError`` naming the file and the reason. ``backend: auto`` tries gigatoken first (the
``[gigatoken]`` extra: it requires numpy) and falls back: for a ``tokenizer.json`` to tiktoken
when the file is byte-level BPE tiktoken counts exactly (``byte_level.py``), then to Hugging Face
``tokenizers``; for a ``.tiktoken`` file to tiktoken. The reason for a fallback is kept in
``Vocabulary.fallback`` for the start-up log. A named backend gets no fallback.

Shipped vocabularies (``source: builtin``, see ``tokenizer_data/README.md``):
    qwen3.6 (alias qwen3.5)  Qwen3.5/3.6 tokenizer.json (zipped), chat_template.jinja
    cl100k_base              OpenAI's cl100k_base.tiktoken (also ``tiktoken_encoding``)

The free bound (tokens <= UTF-8 bytes of the text) is claimed only for vocabularies where it is
provably sound: byte-level BPE whose normaliser is none or NFC (the bound then counts the NFC
form: NFC can triple a text's bytes, e.g. U+1D160) and whose pre-tokenizer adds no bytes.
Anything else (SentencePiece's ``▁`` replacement, ``add_prefix_space``) sets ``bound_sound``
false and every request is counted exactly.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import importlib.util
import json
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.count.tokenizers.byte_level import tiktoken_eligibility, tiktoken_from_json
from gateway.count.tokenizers.encoders import (
    Backend,
    Encoder,
    HFEncoder,
    TiktokenEncoder,
)
from gateway.count.tokenizers.worker import (
    ChildEncoder,
    gigatoken_from_json,
    gigatoken_from_tiktoken,
)
from gateway.settings import ConfigError, TokenizerSettings

if TYPE_CHECKING:
    from gateway.observe.metrics import Metrics

# The token that opens every ChatML message: a text may be cut just before it and the pieces
# counted apart, because special tokens are split out before any BPE runs.
CHATML_START = "<|im_start|>"

_CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}
_CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
# What a .tiktoken file does not carry, for the files OpenAI publishes (by file name).
_OPENAI_FILES: dict[str, tuple[str, dict[str, int]]] = {
    "cl100k_base": ("cl100k", _CL100K_SPECIALS),
    "o200k_base": ("o200k", {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
    "r50k_base": ("gpt2", {"<|endoftext|>": 50256}),
}
# Split regexes for the tiktoken backend, by gigatoken's pretokenizer names.
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
    r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_PATTERNS = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    "cl100k": _CL100K_PAT,
    "gpt4": _CL100K_PAT,
    "o200k": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
    "qwen2": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
    "qwen35": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
        r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
}
# Qwen's tokenizers NFC-normalise before BPE; a .tiktoken file cannot say so.
_NFC_PRETOKENIZERS = frozenset({"qwen2", "qwen35"})
# Pre-tokenizers that only cut the text (never add bytes), for the bound's soundness.
_CUTTING_PRETOKENIZERS = frozenset(
    {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "ByteLevel", "Sequence"}
)

# A short mixed text (prose, code, JSON, CJK, emoji) to warm a tokenizer at load time.
_WARMUP = (
    "The gateway counts every prompt before it routes it; a monster prompt must not stall "
    "the small ones. 日本語と中文も少し。 Emoji 🎉 and marks: e\u0301, क़.\n"
    "def route(tokens: int) -> str:\n    return 'heavy' if tokens >= 32768 else 'fast'\n"
    '{"id": 17, "name": "shapegate", "tags": ["llm", "gateway"], "ok": true}\n'
)


@dataclass(frozen=True, slots=True)
class _Builtin:
    kind: str  # "hf_json" | "tiktoken"
    folder: str
    file: str


_BUILTIN = {
    "qwen3.6": _Builtin("hf_json", "qwen3.6", "tokenizer.json.zip"),
    "qwen3.5": _Builtin("hf_json", "qwen3.6", "tokenizer.json.zip"),
    "cl100k_base": _Builtin("tiktoken", "cl100k_base", "cl100k_base.tiktoken"),
}
# Every name ``source: builtin`` accepts.
BUILTIN_NAMES = tuple(_BUILTIN)
# The distinct vocabularies shipped (qwen3.5 is the same files as qwen3.6).
BUILTIN_VOCABULARIES = ("qwen3.6", "cl100k_base")


@contextmanager
def builtin_path(name: str) -> Iterator[Path]:
    """The shipped file of a builtin vocabulary, as a filesystem path."""
    spec = _BUILTIN.get(name)
    if spec is None:
        raise ConfigError(f"unknown builtin tokenizer {name!r}; shipped: {', '.join(_BUILTIN)}")
    folder = importlib.resources.files("gateway.count").joinpath("tokenizer_data", spec.folder)
    with importlib.resources.as_file(folder) as path:
        yield path / spec.file


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """A loaded, warmed tokenizer and what counting needs to know about it."""

    name: str
    encoder: Encoder
    # Added-token strings the encoder matches inside text as one token each.
    specials: frozenset[str]
    # The text is NFC-normalised before BPE (the bound then measures the NFC form).
    nfc: bool
    # tokens <= UTF-8 bytes (of the NFC form when ``nfc``) is guaranteed for this vocabulary.
    bound_sound: bool
    # Tokens the tokenizer's post-processor adds to a completions prompt (a BOS, say).
    completion_extra: int
    # The model's own Jinja chat template, where one ships with the files.
    chat_template: str | None
    template_vars: Mapping[str, str]
    # Where it came from (a path, or ``builtin:NAME``), and why the preferred backend is not used.
    origin: str
    fallback: str | None = None
    split_token: str | None = field(default=None)

    @property
    def id(self) -> str:
        return f"{self.name}/{self.encoder.backend}"


def load_vocabulary(
    settings: TokenizerSettings,
    on_fallback: Callable[[str, BaseException, str], None] | None = None,
    limits: EncoderLimits | None = None,
) -> Vocabulary:
    """Load and warm one tokenizer; ``on_fallback(backend, exc, decision)`` hears every fallback.

    ``limits`` says where gigatoken runs (``EncoderLimits``; default: a child process recycled
    past ``DEFAULT_MAX_RSS_MB``)."""
    limits = limits or EncoderLimits()
    if settings.source == "builtin":
        name = settings.name or ""
        with builtin_path(name) as path:
            if _BUILTIN[name].kind == "hf_json":
                return _from_hf_json(name, path, settings, on_fallback, limits)
            return _from_tiktoken_file(
                name, path, "cl100k", _CL100K_SPECIALS, settings, on_fallback, limits
            )
    if settings.source == "hf_json":
        path = Path(settings.path or "")
        # A model folder names the vocabulary: .../Qwen3.6-35B-A3B/tokenizer.json -> Qwen3.6-35B-A3B
        name = path.name if path.is_dir() else (path.parent.name or path.name)
        return _from_hf_json(name, path, settings, on_fallback, limits)
    if settings.source == "tiktoken_file":
        path = Path(settings.path or "")
        name = path.name.removesuffix(".tiktoken")
        known = _OPENAI_FILES.get(name)
        pretokenizer = settings.pretokenizer or (known[0] if known else None)
        if pretokenizer is None:
            raise ConfigError(
                f"tokenizer file {path}: a .tiktoken file needs 'pretokenizer' "
                f"(one of {', '.join(_PATTERNS)})"
            )
        specials = dict(settings.special_tokens) or (dict(known[1]) if known else {})
        return _from_tiktoken_file(
            name, path, pretokenizer, specials, settings, on_fallback, limits
        )
    return _from_tiktoken_encoding(settings, on_fallback, limits)


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


def _split_token(specials: frozenset[str]) -> str | None:
    """``<|im_start|>`` if the vocabulary matches it as a special token no other one overlaps."""
    if CHATML_START not in specials:
        return None
    for other in specials - {CHATML_START}:
        overlaps = any(CHATML_START.startswith(other[-i:]) for i in range(1, len(other) + 1))
        if CHATML_START in other or overlaps:
            return None
    return CHATML_START


def _from_hf_json(
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
        _require_gigatoken()
        return _in_child(functools.partial(gigatoken_from_json, data), "gigatoken", limits)

    def tiktoken_() -> Encoder:
        reason = tiktoken_eligibility(config)
        if reason is not None:  # a property of the file, not a failure: no error counted
            raise BackendUnavailable(f"tiktoken cannot count this tokenizer.json exactly: {reason}")
        return _in_child(functools.partial(tiktoken_from_json, data), "tiktoken", limits)

    def hf() -> Encoder:
        import tokenizers

        return HFEncoder(tokenizers.Tokenizer.from_str(data.decode("utf-8")))

    order: dict[str, list[tuple[Backend, Callable[[], Encoder]]]] = {
        "auto": [("gigatoken", gigatoken), ("tiktoken", tiktoken_), ("hf", hf)],
        "gigatoken": [("gigatoken", gigatoken)],
        "tiktoken": [("tiktoken", tiktoken_)],
        "hf": [("hf", hf)],
    }
    encoder, fallback = _first_that_loads(order[settings.backend], path, on_fallback)
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
        split_token=_split_token(specials),
    )


def _from_tiktoken_file(
    name: str,
    path: Path,
    pretokenizer: str,
    specials: Mapping[str, int],
    settings: TokenizerSettings,
    on_fallback: Callable[[str, BaseException, str], None] | None,
    limits: EncoderLimits,
) -> Vocabulary:
    if settings.backend == "hf":
        raise ConfigError(f"tokenizer file {path}: backend hf cannot read a .tiktoken file")
    if pretokenizer not in _PATTERNS:
        raise ConfigError(
            f"tokenizer file {path}: unknown pretokenizer {pretokenizer!r} "
            f"(one of {', '.join(_PATTERNS)})"
        )
    if not path.is_file():
        raise ConfigError(f"cannot read tokenizer file {path}: no such file")
    if name == "cl100k_base" and hashlib.sha256(path.read_bytes()).hexdigest() != _CL100K_SHA256:
        raise ConfigError(f"tokenizer file {path} is not OpenAI's cl100k_base (sha256 differs)")
    nfc = pretokenizer in _NFC_PRETOKENIZERS

    def gigatoken() -> Encoder:
        _require_gigatoken()
        recipe = functools.partial(
            gigatoken_from_tiktoken, str(path), pretokenizer, dict(specials), nfc
        )
        return _in_child(recipe, "gigatoken", limits)

    def tiktoken_() -> Encoder:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(path))
        encoding = tiktoken.Encoding(
            name,
            pat_str=_PATTERNS[pretokenizer],
            mergeable_ranks=ranks,
            special_tokens=dict(specials),
        )
        return TiktokenEncoder(encoding, nfc=nfc)

    order: dict[str, list[tuple[Backend, Callable[[], Encoder]]]] = {
        "auto": [("gigatoken", gigatoken), ("tiktoken", tiktoken_)],
        "gigatoken": [("gigatoken", gigatoken)],
        "tiktoken": [("tiktoken", tiktoken_)],
    }
    encoder, fallback = _first_that_loads(order[settings.backend], path, on_fallback)
    return Vocabulary(
        name=name,
        encoder=encoder,
        specials=frozenset(specials),
        nfc=nfc,
        bound_sound=True,
        completion_extra=0,
        chat_template=None,
        template_vars={},
        origin=str(path),
        fallback=fallback,
        split_token=_split_token(frozenset(specials)),
    )


def _from_tiktoken_encoding(
    settings: TokenizerSettings,
    on_fallback: Callable[[str, BaseException, str], None] | None,
    limits: EncoderLimits,
) -> Vocabulary:
    name = settings.name or ""
    if name in _BUILTIN and _BUILTIN[name].kind == "tiktoken":
        return load_vocabulary(
            settings.model_copy(update={"source": "builtin"}), on_fallback, limits
        )
    if settings.backend not in ("auto", "tiktoken"):
        raise ConfigError(
            f"tokenizer encoding {name!r}: only backend tiktoken can load a named "
            "encoding other than the shipped cl100k_base"
        )
    import tiktoken

    try:
        encoding = tiktoken.get_encoding(name)
    except Exception as exc:
        raise ConfigError(
            f"cannot load tiktoken encoding {name!r} offline (put its .tiktoken file "
            f"in TIKTOKEN_CACHE_DIR or use source tiktoken_file): {exc}"
        ) from exc
    encoder = TiktokenEncoder(encoding, nfc=False)
    _warm(encoder, Path(name))
    fallback = "gigatoken needs a .tiktoken file" if settings.backend == "auto" else None
    specials = frozenset(encoding.special_tokens_set)
    return Vocabulary(
        name=name,
        encoder=encoder,
        specials=specials,
        nfc=False,
        bound_sound=True,
        completion_extra=0,
        chat_template=None,
        template_vars={},
        origin=f"tiktoken:{name}",
        fallback=fallback,
        split_token=_split_token(specials),
    )


# A child that only loaded the Qwen vocabulary sits near 170 MB; past this it is replaced.
DEFAULT_MAX_RSS_MB = 384.0


@dataclass(frozen=True, slots=True)
class EncoderLimits:
    """Where gigatoken (and tiktoken on a tokenizer.json) runs: in a child process replaced once
    its resident memory passes ``max_rss_mb`` (gateway/count/tokenizers/worker.py), or, with
    ``max_rss_mb=None``, in this process, where gigatoken's encode cache grows without bound."""

    max_rss_mb: float | None = DEFAULT_MAX_RSS_MB
    metrics: Metrics | None = None
    # Characters each child process encodes before it answers (tokenizers/warmup.py).
    warm_chars: int = 0


# What the start-up log says when gigatoken is missing (a plain install: it requires numpy).
GIGATOKEN_MISSING = "gigatoken is not installed (pip install 'shapegate[gigatoken]')"


class BackendUnavailable(Exception):
    """The backend cannot serve this vocabulary by design: its optional package is not installed
    (a plain install's normal state), or the file is one it cannot count exactly. ``auto``
    passes over it without counting an error; the reason still reaches ``tokenizer.loaded``."""


def _require_gigatoken() -> None:
    """Say at once that gigatoken is missing, rather than after starting a child process."""
    if importlib.util.find_spec("gigatoken") is None:
        raise BackendUnavailable(GIGATOKEN_MISSING)


def _in_child(recipe: Callable[[], Encoder], backend: Backend, limits: EncoderLimits) -> Encoder:
    if limits.max_rss_mb is None:
        return recipe()
    return ChildEncoder(
        recipe,
        backend=backend,
        max_rss_mb=limits.max_rss_mb,
        metrics=limits.metrics,
        warm_chars=limits.warm_chars,
    )


def _first_that_loads(
    order: list[tuple[Backend, Callable[[], Encoder]]],
    path: Path,
    on_fallback: Callable[[str, BaseException, str], None] | None,
) -> tuple[Encoder, str | None]:
    reasons: list[str] = []
    last: BaseException | None = None
    for i, (backend, build) in enumerate(order):
        try:
            encoder = build()
            _warm(encoder, path)
        # pyo3's PanicException (a Rust assertion in gigatoken) derives from BaseException.
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            last = exc
            if isinstance(exc, BackendUnavailable):  # by design: reported, not counted
                reasons.append(f"{backend}: {exc}")
                continue
            reasons.append(f"{backend}: {type(exc).__name__}: {str(exc)[:200]}")
            if i + 1 < len(order) and on_fallback is not None:
                on_fallback(backend, exc, f"fallback_to_{order[i + 1][0]}")
            continue
        return encoder, ("; ".join(reasons) or None)
    why = "; ".join(reasons) or "no backend to try"
    raise ConfigError(f"cannot load tokenizer file {path}: {why}") from last


def _warm(encoder: Encoder, path: Path) -> None:
    """Pay the first-encode costs now (gigatoken: ~80 ms single, ~350 ms for the batch path)."""
    small = encoder.count_many([_WARMUP])
    large = encoder.count_many([_WARMUP * 64])
    if not small or small[0] <= 0 or large[0] < small[0]:
        raise ConfigError(f"tokenizer file {path} encodes nothing: is it a real vocabulary?")
