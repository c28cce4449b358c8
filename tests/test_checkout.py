"""The suite tests the checkout: subprocesses import this tree, and the installed `shapegate`
entry point cannot stand in for it (the conftest puts one that only exits 1 first on PATH)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.support.checkout import ROOT, checkout_env, gateway_cli


def test_the_installed_entry_point_is_poisoned_for_the_whole_run(
    installed_shapegate_fails: Path,
) -> None:
    assert shutil.which("shapegate") == str(installed_shapegate_fails)
    assert subprocess.run(["shapegate", "--help"], check=False).returncode == 1
    # And what the code under test starts itself (demo engines, benchmark children) with this
    # process's environment imports the checkout first.
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_a_subprocess_imports_the_checkout_even_with_another_copy_on_its_path(
    tmp_path: Path,
) -> None:
    # A stale copy of the packages, as an old install or another worktree would provide.
    for package in ("gateway", "engine_pool"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("raise ImportError('stale copy')\n")
    probe = "import gateway, engine_pool; print(gateway.__file__); print(engine_pool.__file__)"
    out = subprocess.run(
        [gateway_cli()[0], "-c", probe],
        cwd=ROOT,
        env=checkout_env({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [Path(line).parent.parent for line in out] == [ROOT, ROOT]
    help_text = subprocess.run(
        gateway_cli("--help"), cwd=ROOT, env=checkout_env(), capture_output=True, check=True
    )
    assert b"serve" in help_text.stdout
