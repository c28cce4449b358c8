"""Where an encoder runs and which backend serves a vocabulary: the first of an ordered list that
loads and warms (``first_that_loads``), in a child process or in this one (``EncoderLimits``).

Contract: a backend that cannot serve a vocabulary by design (``BackendUnavailable``: its
optional package is missing, or the file is one it cannot count exactly) is passed over without
counting an error; any other failure is heard by ``on_fallback(backend, exc, decision)`` before
the next backend is tried. Every reason is kept for the start-up log; when none loads, a
``ConfigError`` names the file and every reason. Each encoder is warmed before it is returned
(the first encode of a gigatoken tokenizer costs ~100x a later one, so it is paid at start-up).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.count.tokenizers.encoders import Backend, Encoder
from gateway.count.tokenizers.worker import ChildEncoder
from gateway.settings import ConfigError

if TYPE_CHECKING:
    from gateway.observe.metrics import Metrics

# A short mixed text (prose, code, JSON, CJK, emoji) to warm a tokenizer at load time.
_WARMUP = (
    "The gateway counts every prompt before it routes it; a monster prompt must not stall "
    "the small ones. 日本語と中文も少し。 Emoji 🎉 and marks: e\u0301, क़.\n"
    "def route(tokens: int) -> str:\n    return 'heavy' if tokens >= 32768 else 'fast'\n"
    '{"id": 17, "name": "shapegate", "tags": ["llm", "gateway"], "ok": true}\n'
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


def require_gigatoken() -> None:
    """Say at once that gigatoken is missing, rather than after starting a child process."""
    if importlib.util.find_spec("gigatoken") is None:
        raise BackendUnavailable(GIGATOKEN_MISSING)


def in_child(recipe: Callable[[], Encoder], backend: Backend, limits: EncoderLimits) -> Encoder:
    if limits.max_rss_mb is None:
        return recipe()
    return ChildEncoder(
        recipe,
        backend=backend,
        max_rss_mb=limits.max_rss_mb,
        metrics=limits.metrics,
        warm_chars=limits.warm_chars,
    )


def first_that_loads(
    order: list[tuple[Backend, Callable[[], Encoder]]],
    path: Path,
    on_fallback: Callable[[str, BaseException, str], None] | None,
) -> tuple[Encoder, str | None]:
    reasons: list[str] = []
    last: BaseException | None = None
    for i, (backend, build) in enumerate(order):
        try:
            encoder = build()
            warm(encoder, path)
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


def warm(encoder: Encoder, path: Path) -> None:
    """Pay the first-encode costs now (gigatoken: ~80 ms single, ~350 ms for the batch path)."""
    small = encoder.count_many([_WARMUP])
    large = encoder.count_many([_WARMUP * 64])
    if not small or small[0] <= 0 or large[0] < small[0]:
        raise ConfigError(f"tokenizer file {path} encodes nothing: is it a real vocabulary?")
