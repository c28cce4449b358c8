"""Optional dependencies: numpy and matplotlib come with the ``bench`` extra, never with serve;
OpenTelemetry (gateway/observe/tracing.py) with the ``otel`` extra, imported only when tracing is
on.

``pip install shapegate`` installs what the gateway needs to serve; the benchmarks' adversarial
inputs (numpy) and every plot (matplotlib: ``shapegate bench``, ``shapegate replay --plot``)
need ``pip install 'shapegate[bench]'``. Importing them goes through here, at the point of use,
so a missing one is a ``MissingExtra`` naming the extra (``shapegate`` prints it and exits 2),
not an ``ImportError`` from deep inside a command, and never a failure to start the gateway.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

EXTRA = "bench"


class MissingExtra(Exception):
    """An optional dependency is not installed; the message says which extra brings it."""

    def __init__(self, module: str, extra: str = EXTRA) -> None:
        super().__init__(
            f"{module} is not installed: it comes with shapegate's [{extra}] extra "
            f"(pip install 'shapegate[{extra}]')"
        )


def optional(module: str, extra: str = EXTRA) -> ModuleType:
    """``import module``, or ``MissingExtra`` when the extra that brings it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == module.split(".", maxsplit=1)[0]:
            raise MissingExtra(module, extra) from exc
        raise


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    optional("matplotlib").use("Agg")
    return optional("matplotlib.pyplot")


def side_by_side(width: float, height: float) -> tuple[Any, Any]:
    """A figure of two plots side by side, and its two axes."""
    return pyplot().subplots(1, 2, figsize=(width, height))  # type: ignore[no-any-return]


def save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot().close(figure)
