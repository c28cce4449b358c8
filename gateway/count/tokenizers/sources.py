"""Load a model's vocabulary from its ``TokenizerSettings``: shipped or local files, no network.

Contract: ``load_vocabulary(settings)`` returns a warmed ``Vocabulary`` (vocab.py; the first
encode of a gigatoken tokenizer costs ~100x a later one, so it is paid here, at start-up) or
raises ``ConfigError`` naming the file and the reason. ``backend: auto`` tries gigatoken first
(the ``[gigatoken]`` extra: it requires numpy) and falls back: for a ``tokenizer.json``
(hf_json.py) to tiktoken when the file is byte-level BPE tiktoken counts exactly
(``byte_level.py``), then to Hugging Face ``tokenizers``; for a ``.tiktoken`` file
(tiktoken_files.py) to tiktoken. The reason for a fallback is kept in ``Vocabulary.fallback``
for the start-up log. A named backend gets no fallback (backends.py).

Shipped vocabularies (``source: builtin``, see ``tokenizer_data/README.md``):
    qwen3.6 (alias qwen3.5)  Qwen3.5/3.6 tokenizer.json (zipped), chat_template.jinja
    cl100k_base              OpenAI's cl100k_base.tiktoken (also ``tiktoken_encoding``)
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.count.tokenizers.backends import EncoderLimits
from gateway.count.tokenizers.hf_json import from_hf_json
from gateway.count.tokenizers.tiktoken_files import (
    CL100K_SPECIALS,
    from_tiktoken_encoding,
    from_tiktoken_file,
    load_tiktoken_file,
)
from gateway.count.tokenizers.vocab import Vocabulary
from gateway.settings import ConfigError, TokenizerSettings


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
                return from_hf_json(name, path, settings, on_fallback, limits)
            return load_tiktoken_file(
                name, path, "cl100k", CL100K_SPECIALS, settings, on_fallback, limits
            )
    if settings.source == "hf_json":
        path = Path(settings.path or "")
        # A model folder names the vocabulary: .../Qwen3.6-35B-A3B/tokenizer.json -> Qwen3.6-35B-A3B
        name = path.name if path.is_dir() else (path.parent.name or path.name)
        return from_hf_json(name, path, settings, on_fallback, limits)
    if settings.source == "tiktoken_file":
        return from_tiktoken_file(settings, on_fallback, limits)
    name = settings.name or ""
    if name in _BUILTIN and _BUILTIN[name].kind == "tiktoken":  # the shipped file, by name
        return load_vocabulary(
            settings.model_copy(update={"source": "builtin"}), on_fallback, limits
        )
    return from_tiktoken_encoding(settings, on_fallback, limits)
