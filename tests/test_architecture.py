"""The import contracts in pyproject.toml cover every module, and no module imports itself back.

``lint-imports`` (scripts/check) enforces the layers; a layers contract says nothing about a
module it does not list, so this test fails when a new module is in no layer. The cycle check
counts every import, type-only ones (``if TYPE_CHECKING:``) and imports inside functions too.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Package modules that import nothing: they belong to no layer of their own.
EMPTY_PACKAGES = {"gateway", "engine_pool", "gateway.dashboard", "gateway.protocols"}


@pytest.fixture(scope="module")
def graph() -> Any:
    return grimp.build_graph("gateway", "engine_pool", cache_dir=None)


def contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return found


def layered() -> set[str]:
    names = set()
    for contract in contracts():
        if contract["type"] == "layers":
            for layer in contract["layers"]:
                names.update(name.strip() for name in layer.split("|"))
    return names


def test_every_module_is_in_a_layer(graph: Any) -> None:
    covered = layered()

    def in_layer(module: str) -> bool:
        parts = module.split(".")
        return any(".".join(parts[:n]) in covered for n in range(len(parts), 0, -1))

    loose = sorted(m for m in graph.modules if m not in EMPTY_PACKAGES and not in_layer(m))
    assert not loose, f"add these modules to a layer in pyproject.toml: {loose}"
    for package in EMPTY_PACKAGES:
        assert not graph.find_modules_directly_imported_by(package)


def test_no_import_cycles(graph: Any) -> None:
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append((module, *back))
    assert not cycles, f"import cycles: {cycles[:5]}"
