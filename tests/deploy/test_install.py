"""The package as a user installs it: ``pip install .`` into a fresh venv, no extras.

The gateway serves without the benchmark-and-plot extra (numpy, matplotlib: ``[bench]``), and a
command that needs the extra says which one, instead of failing at import. numpy still arrives
as gigatoken's own dependency (the exact-count tokenizer on the prompt path needs it); shapegate
itself does not require it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    subprocess.run(
        [str(where / "bin" / "pip"), "install", "-q", "--no-warn-script-location", str(ROOT)],
        check=True,
        timeout=900,
        capture_output=True,
    )
    return where


def run(venv: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
    )


def test_a_plain_install_has_neither_extra_nor_a_requirement_on_it(
    venv: Path, tmp_path: Path
) -> None:
    listed = json.loads(run(venv, "pip", "list", "--format=json").stdout)
    installed = {p["name"].lower() for p in listed}
    assert "shapegate" in installed
    assert "matplotlib" not in installed
    assert "pydantic-settings" not in installed and "pydantic_settings" not in installed
    requires = run(
        venv,
        "python",
        "-c",
        "import importlib.metadata as m, json; print(json.dumps(m.requires('shapegate')))",
    ).stdout
    for name in ("numpy", "matplotlib"):
        assert all('extra == "bench"' in r for r in json.loads(requires) if r.startswith(name)), (
            requires
        )
    loaded = run(
        venv,
        "python",
        "-c",
        "import sys, gateway.tools.cli, gateway.edge.app, gateway.edge.server; "
        "gateway.tools.cli.build_parser(); print('matplotlib' in sys.modules)",
        cwd=tmp_path,
    )
    assert loaded.stdout.strip() == "False", loaded.stderr
    numpy = run(venv, "pip", "show", "numpy").stdout
    assert "shapegate" not in numpy.split("Required-by:")[-1]


def test_serve_runs_without_the_extra(venv: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        gateway = subprocess.Popen(
            [
                str(venv / "bin" / "shapegate"),
                "serve",
                "--config",
                str(ROOT / "configs" / "demo.yaml"),
                "--port",
                str(port),
            ],
            cwd=tmp_path,  # not the checkout: the installed package, not the source tree
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": ""},
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert gateway.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "shapegate serve did not answer in 60 s"
                time.sleep(0.2)
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


def test_a_plot_without_the_extra_names_it(venv: Path, tmp_path: Path) -> None:
    trace = tmp_path / "burst.jsonl"
    assert (
        run(venv, "shapegate", "trace", "synth", "burst-32k", "--out", str(trace)).returncode == 0
    )
    config = str(ROOT / "configs" / "demo.yaml")
    out = tmp_path / "out"
    done = run(
        venv,
        "shapegate",
        "replay",
        "--config",
        config,
        str(trace),
        "--simulate",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "matplotlib is not installed" in done.stderr
    assert "pip install 'shapegate[bench]'" in done.stderr
    assert "Traceback" not in done.stderr
