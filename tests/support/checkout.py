"""Subprocesses run the checkout under test, never whatever ``shapegate`` is installed.

``python -m gateway.tools.cli`` with the checkout root as working directory and first on
``PYTHONPATH`` imports ``gateway`` and ``engine_pool`` from this tree even when the venv holds an
older install (or another worktree's). The suite's conftest also puts a ``shapegate`` that only
exits 1 first on ``PATH``, so a test that starts the installed entry point fails loudly.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkout_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the checkout first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    paths = [str(ROOT), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def gateway_cli(*args: str) -> list[str]:
    """The argv of ``shapegate ARGS`` run from the checkout (pair it with ``cwd=ROOT``)."""
    return [sys.executable, "-m", "gateway.tools.cli", *args]


def shapegate_on_path(folder: Path) -> dict[str, str]:
    """``checkout_env()`` with a ``shapegate`` first on PATH that runs this checkout, so that a
    printed ``shapegate ...`` line can be run exactly as printed (``bash -c LINE``)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "shapegate"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gateway.tools.cli "$@"\n')
    script.chmod(0o755)
    env = checkout_env()
    env["PATH"] = os.pathsep.join([str(folder), env.get("PATH", "")])
    return env
