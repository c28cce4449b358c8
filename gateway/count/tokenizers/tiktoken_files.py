"""tiktoken vocabularies as ``Vocabulary``: a ``.tiktoken`` file (``source: tiktoken_file``, or
the shipped cl100k_base) with the pre-tokenizer and special tokens the file cannot carry, and a
named encoding from tiktoken's cache (``source: tiktoken_encoding``). ``backend: auto`` tries
gigatoken first, then tiktoken; the free bound is sound for every one of them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

from gateway.count.tokenizers.backends import (
    EncoderLimits,
    first_that_loads,
    in_child,
    require_gigatoken,
    warm,
)
from gateway.count.tokenizers.child import gigatoken_from_tiktoken
from gateway.count.tokenizers.encoders import Backend, Encoder, TiktokenEncoder
from gateway.count.tokenizers.vocab import Vocabulary, split_token
from gateway.settings import ConfigError, TokenizerSettings

CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}
_CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
# What a .tiktoken file does not carry, for the files OpenAI publishes (by file name).
_OPENAI_FILES: dict[str, tuple[str, dict[str, int]]] = {
    "cl100k_base": ("cl100k", CL100K_SPECIALS),
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


def from_tiktoken_file(
    settings: TokenizerSettings,
    on_fallback: Callable[[str, BaseException, str], None] | None,
    limits: EncoderLimits,
) -> Vocabulary:
    """A ``.tiktoken`` file a policy names (``source: tiktoken_file``): OpenAI's files by name
    need no ``pretokenizer`` or ``special_tokens``; any other file needs its pretokenizer."""
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
    return load_tiktoken_file(name, path, pretokenizer, specials, settings, on_fallback, limits)


def load_tiktoken_file(
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
        require_gigatoken()
        recipe = functools.partial(
            gigatoken_from_tiktoken, str(path), pretokenizer, dict(specials), nfc
        )
        return in_child(recipe, "gigatoken", limits)

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
    encoder, fallback = first_that_loads(order[settings.backend], path, on_fallback)
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
        split_token=split_token(frozenset(specials)),
    )


def from_tiktoken_encoding(
    settings: TokenizerSettings,
    on_fallback: Callable[[str, BaseException, str], None] | None,
    limits: EncoderLimits,
) -> Vocabulary:
    """A tiktoken encoding by name (``source: tiktoken_encoding``) other than the shipped one,
    from tiktoken's own cache: no network."""
    name = settings.name or ""
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
    warm(encoder, Path(name))
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
        split_token=split_token(specials),
    )
