"""The shipped policies and engine profiles resolve from any directory; a local file wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_pool.sim.profile import load_profile
from gateway.shipped import configs_dir, policy_names, profile_names, resolve_policy

ROOT = Path(__file__).resolve().parents[2]


def test_one_copy_the_repository_link_points_at_the_package() -> None:
    assert (ROOT / "configs").resolve() == configs_dir().resolve()
    assert policy_names() == ("demo", "production-two-lanes", "shared-pool")
    assert profile_names() == ("h100-fast", "h100-heavy", "h100-heavy-lending", "h100-shared")


def test_documented_paths_and_names_resolve_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shipped = configs_dir() / "demo.yaml"
    for ref in ("configs/demo.yaml", "./configs/demo.yaml", "demo.yaml", "demo"):
        assert resolve_policy(ref) == shipped, ref
    assert resolve_policy("configs/nope.yaml") == Path("configs/nope.yaml")
    assert resolve_policy("other/demo.yaml") == Path("other/demo.yaml")
    assert load_profile("h100-fast").name == "h100-fast"
    assert load_profile("configs/engines/h100-heavy.yaml").name == "h100-heavy"


def test_a_local_file_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text("mine: true\n")
    assert resolve_policy("configs/demo.yaml") == Path("configs/demo.yaml")
