"""The policies and engine profiles that ship inside the package (``gateway/configs/``).

Contract:
- The files live once, in ``gateway/configs/`` (package data, read with ``importlib.resources``);
  the repository's ``configs/`` is a link to that folder, so ``configs/demo.yaml`` names the same
  file in a checkout and after ``pip install shapegate``.
- ``resolve_policy(ref)`` turns what a user typed after ``--config`` into a file: an existing path
  wins; otherwise a shipped policy by name (``demo``), by file name (``demo.yaml``) or by its
  documented path (``configs/demo.yaml``), so the README's commands work from any directory.
  Anything else comes back unchanged, and reading it fails with the path the user gave.
- Engine profiles ship with the simulator (``engine_pool/sim/profiles/``, linked as
  ``configs/engines/``); ``shipped_profile`` and ``profile_names`` come from there.

Example::

    resolve_policy("configs/demo.yaml")  # .../site-packages/gateway/configs/demo.yaml
    policy_names()                       # ("demo", "production-two-lanes", "shared-pool")
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from engine_pool.sim.profile import available_profiles, shipped_profile

_SUFFIXES = (".yaml", ".yml")


def configs_dir() -> Path:
    """The shipped ``configs`` folder. pip installs wheels unpacked, so it is a real folder."""
    return Path(str(importlib.resources.files("gateway").joinpath("configs")))


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in configs_dir().glob("*.yaml")))


def profile_names() -> tuple[str, ...]:
    return available_profiles()


def _shipped(ref: str, folder: Path, documented: str) -> Path | None:
    name = ref.removeprefix("./").removeprefix(documented)
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    if not name or "/" in name:
        return None
    candidate = folder / f"{name}.yaml"
    return candidate if candidate.is_file() else None


def resolve_policy(ref: str | Path) -> Path:
    """An existing file, else the shipped policy of that name, else ``ref`` unchanged."""
    path = Path(ref)
    if path.exists():
        return path
    return _shipped(str(ref), configs_dir(), "configs/") or path


__all__ = ["configs_dir", "policy_names", "profile_names", "resolve_policy", "shipped_profile"]
