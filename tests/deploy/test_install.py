"""The package as a user installs it: ``pip install .`` into a fresh venv, no extras.

Neither numpy nor matplotlib arrives: the plots are the ``[bench]`` extra, and gigatoken (the
fastest exact tokenizer, which requires numpy and awkward) is the ``[gigatoken]`` extra. The
gateway serves and counts exactly without them: the shipped Qwen3.6 vocabulary falls back to
tiktoken on ranks rewritten from its tokenizer.json, and the start-up log names the extra. A
command that needs the plot extra says which one, instead of failing at import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from gateway.count.tokens import TokenCounter
from gateway.protocols.openai import parse_request
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
SIM_ARGS = ("--profile", "h100-fast", "--time-scale", "0.01")
NOT_INSTALLED = ("numpy", "matplotlib", "gigatoken", "awkward", "pydantic-settings")


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


# The suite puts the checkout on PYTHONPATH (tests/conftest.py): the installed package must not
# see it.
INSTALLED = {**os.environ, "PYTHONPATH": ""}


def run(venv: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
        env=INSTALLED,
    )


def test_a_plain_install_pulls_neither_numpy_nor_matplotlib(venv: Path, tmp_path: Path) -> None:
    listed = json.loads(run(venv, "pip", "list", "--format=json").stdout)
    installed = {p["name"].lower().replace("_", "-") for p in listed}
    assert "shapegate" in installed and "tiktoken" in installed
    assert not installed & set(NOT_INSTALLED), installed & set(NOT_INSTALLED)
    requires = run(
        venv,
        "python",
        "-c",
        "import importlib.metadata as m, json; print(json.dumps(m.requires('shapegate')))",
    ).stdout
    extras = {"numpy": "bench", "matplotlib": "bench", "gigatoken": "gigatoken"}
    for name, extra in extras.items():
        named = [r for r in json.loads(requires) if r.startswith(name)]
        assert named and all(f'extra == "{extra}"' in r for r in named), requires
    loaded = run(
        venv,
        "python",
        "-c",
        "import sys, gateway.tools.cli, gateway.edge.app, gateway.edge.server; "
        "gateway.tools.cli.build_parser(); print('site-packages' in gateway.__file__)",
        cwd=tmp_path,
    )
    assert loaded.stdout.strip() == "True", loaded.stderr


def started(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert process.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                assert r.status == 200
                return
        except OSError:
            assert time.monotonic() < deadline, f"{url} did not answer in 90 s: {log.read_text()}"
            time.sleep(0.2)


@pytest.fixture
def engine(venv: Path, tmp_path: Path) -> Iterator[str]:
    """The installed simulator, one fast engine."""
    port = free_port()
    log = tmp_path / "sim.log"
    with log.open("wb") as sink:
        sim = subprocess.Popen(
            [str(venv / "bin" / "shapegate"), "sim", "--port", str(port), *SIM_ARGS],
            cwd=tmp_path,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=INSTALLED,
        )
    try:
        started(sim, f"http://127.0.0.1:{port}/health", log)
        yield f"http://127.0.0.1:{port}"
    finally:
        sim.kill()
        sim.wait()


POLICY = """\
models:
  - name: qwen3.6
    tokenizer: {{source: builtin, name: qwen3.6}}
    max_model_len: 1048576
clusters:
  - name: main
    endpoints: [{engine}]
lanes:
  - name: fast
    max_prompt_tokens: 1048576
    clusters: [main]
    slots: {{lane: 8, per_endpoint: 8}}
"""


def test_serve_counts_exactly_without_the_extras(venv: Path, tmp_path: Path, engine: str) -> None:
    """The plain install serves a request and its token header is the exact count (Hugging
    Face's, computed here), made by tiktoken; the log says gigatoken's extra is missing."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(engine=engine), encoding="utf-8")
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        gateway = subprocess.Popen(
            [
                str(venv / "bin" / "shapegate"),
                "serve",
                "--config",
                str(policy),
                "--port",
                str(port),
            ],
            cwd=tmp_path,  # not the checkout: the installed package, not the source tree
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=INSTALLED,
        )
    try:
        started(gateway, f"http://127.0.0.1:{port}/readyz", log)
        text = "Dense JSON counts 2-3 characters a token: " + json.dumps(
            [{"id": i, "v": i * 0.37, "tag": f"k{i:x}"} for i in range(400)]
        )
        body = {
            "model": "qwen3.6",
            "messages": [{"role": "user", "content": text + " 日本語 🎉 cafe\u0301"}],
            "max_tokens": 4,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            header = response.headers["x-shapegate-prompt-tokens"]
        prompt = parse_request("chat", orjson.dumps(body)).prompt
        # The policy names no template: the model's own (``auto``), counted here in-process.
        own = TokenCounter.for_models(
            [{"name": "qwen3.6", "tokenizer": {"source": "builtin", "name": "qwen3.6"}}]
        )
        try:
            assert int(header) == own.count_sync("qwen3.6", prompt).tokens
        finally:
            own.close()
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0
        loaded = [
            json.loads(line)
            for line in log.read_text().splitlines()
            if '"tokenizer.loaded"' in line
        ]
        assert [(e["backend"], e["tokenizer"]) for e in loaded] == [
            ("tiktoken", "qwen3.6/tiktoken")
        ], log.read_text()
        assert "pip install 'shapegate[gigatoken]'" in loaded[0]["fallback"]
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
