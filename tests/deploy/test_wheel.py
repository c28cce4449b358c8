"""The built wheel, installed (not editable) in a fresh venv and used from another directory.

CI's wheel job (.ci/run) installs the wheel with its dependencies from the index; this test
installs only the wheel and borrows the dependencies from the running environment through a
``.pth`` line (they are not what is under test: the package's own files are), then runs the
same ``scripts/wheel-smoke``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_works_from_any_directory(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("shapegate-*.whl")
    # The suite puts the checkout first on PYTHONPATH: without this, pip would find the
    # checkout's metadata, call the wheel installed already, and the smoke would import nothing.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        env=env,
        check=True,
        timeout=300,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    smoke = subprocess.run(
        [str(ROOT / "scripts" / "wheel-smoke"), str(venv / "bin")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert "wheel smoke: ok" in smoke.stdout
