"""The mutation list (tests/mutations/mutations.toml, run by scripts/mutate) still fits the code:
every anchor occurs exactly once in its file, and every named test exists. The mutants
themselves run outside the suite (`scripts/mutate`, several minutes)."""

from __future__ import annotations

import ast
import tomllib
from typing import Any

import pytest

from tests.support.checkout import ROOT

MUTATIONS: list[dict[str, Any]] = tomllib.loads(
    (ROOT / "tests" / "mutations" / "mutations.toml").read_text()
)["mutation"]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m["name"] for m in MUTATIONS])
def test_each_mutation_still_applies_and_names_real_tests(mutation: dict[str, Any]) -> None:
    source = (ROOT / mutation["file"]).read_text()
    assert source.count(mutation["find"]) == 1, "anchor moved: rewrite it on the code it names"
    assert mutation["find"] != mutation["replace"]
    assert mutation["tests"]
    for test_id in mutation["tests"]:
        path, _, name = test_id.partition("::")
        module = ast.parse((ROOT / path).read_text())
        defined = {
            node.name
            for node in module.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        assert not name or name in defined, test_id
