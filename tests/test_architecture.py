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
EMPTY_PACKAGES = {
    "gateway",
    "engine_pool",
    *(
        f"gateway.{p}"
        for p in ("edge", "request", "count", "slots", "upstream", "observe", "tuning", "tools")
    ),
    "gateway.edge.admin",
    "gateway.protocols",
    "gateway.core",
}
FOLDERS = (
    "core",
    "protocols",
    "observe",
    "count",
    "slots",
    "upstream",
    "request",
    "edge",
    "tuning",
)
FOLDERS = (*FOLDERS, "tools")
# The imports that never happen (issue 28): importer -> what it never imports, at any depth.
NEVER: dict[str, tuple[str, ...]] = {
    "gateway.request": ("gateway.edge", "gateway.tools", "gateway.tuning"),
    **{
        f"gateway.{source}": ("gateway.request", "gateway.edge", "gateway.tools", "gateway.tuning")
        for source in ("count", "slots", "observe", "upstream")
    },
    **{
        f"gateway.{leaf}": tuple(f"gateway.{folder}" for folder in FOLDERS)
        for leaf in ("settings", "errors", "lifetime", "shipped")
    },
    "gateway.tuning": ("gateway.tools", "gateway.edge"),
    "gateway.edge": ("gateway.tools",),
    "engine_pool": ("gateway",),
}


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


def architecture_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Architecture") :]
    return section.split("```\n", 2)[1].splitlines()


def test_the_readme_architecture_matches_the_folders() -> None:
    """Every file the README's Architecture block lists exists, and every module of a folder it
    lists file by file is listed (as an entry or named in an entry's line of that folder)."""
    entries: dict[Path, str] = {}  # path -> the text of its line(s)
    stack: list[tuple[int, Path]] = []
    last = ROOT
    for line in architecture_block():
        name = line.strip().split(" ")[0]
        indent = len(line) - len(line.lstrip())
        if not name.endswith((".py", "/")) or indent % 2:
            if last in entries:  # a continuation line of the last entry
                entries[last] += " " + line.strip()
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        last = (stack[-1][1] if stack else ROOT) / name.rstrip("/")
        entries[last] = line
        stack.append((indent, last))
    missing = [str(p.relative_to(ROOT)) for p in entries if not p.exists()]
    assert not missing, f"the README lists what does not exist: {missing}"
    folders = {p.parent for p in entries if p.parent != ROOT} | {
        ROOT / "gateway",
        ROOT / "engine_pool",
    }
    unlisted = []
    for package in ("gateway", "engine_pool"):
        for module in sorted((ROOT / package).rglob("*.py")):
            if module.name == "__init__.py" or module.parent not in folders or module in entries:
                continue
            siblings = " ".join(text for p, text in entries.items() if p.parent == module.parent)
            if module.name not in siblings:
                unlisted.append(str(module.relative_to(ROOT)))
    assert not unlisted, f"add these modules to the README's Architecture block: {unlisted}"


def forbidden_pairs() -> set[tuple[str, str]]:
    pairs = set()
    for contract in contracts():
        if contract["type"] == "forbidden":
            for source in contract["source_modules"]:
                pairs.update((source, target) for target in contract["forbidden_modules"])
    return pairs


def test_the_forbidden_imports_are_contracts_and_never_happen(graph: Any) -> None:
    """Each pair of NEVER is a forbidden contract lint-imports enforces, and grimp finds no chain
    of imports (type-only and in-function ones included) from the one to the other."""
    declared = forbidden_pairs()
    wanted = {(source, target) for source, targets in NEVER.items() for target in targets}
    assert wanted <= declared, f"add forbidden contracts for {sorted(wanted - declared)}"
    happening = [
        (source, target)
        for source, target in sorted(wanted)
        if graph.chain_exists(importer=source, imported=target, as_packages=True)
    ]
    assert not happening, f"forbidden imports happen: {happening}"


def test_every_folder_is_one_layer() -> None:
    """The gateway's layers contract is written by folder: each folder (and each top-level
    module) appears in exactly one layer, whole."""
    gateway_layers = next(
        c["layers"] for c in contracts() if c["type"] == "layers" and "gateway.tools" in c["layers"]
    )
    names = [name.strip() for layer in gateway_layers for name in layer.split("|")]
    assert len(names) == len(set(names))
    assert all(name.count(".") <= 1 for name in names), names
    on_disk = {
        f"gateway.{p.stem if p.suffix else p.name}"
        for p in (ROOT / "gateway").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert on_disk == set(names) - {"engine_pool"}
