"""``shapegate init`` writes a policy that check-config passes and that serves."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import httpx
import orjson
import pytest

from engine_pool.sim.server import run_sim
from gateway.count.tokens import TokenCounter
from gateway.tools.cli import main
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import chat
from tests.support.checkout import ROOT, checkout_env, gateway_cli, shapegate_on_path
from tests.support.servers import free_port, until_ok


def test_init_refuses_to_overwrite_and_checks_what_it_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "policy.yaml"
    out.write_text("mine\n")
    assert main(["init", "--engine", "http://127.0.0.1:9101", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "mine\n"
    bad = ["init", "--engine", "http://127.0.0.1:9101", "--tokenizer", str(tmp_path), "--force"]
    assert main([*bad, "--out", str(out)]) == 2
    assert "holds no tokenizer.json" in capsys.readouterr().err
    assert out.read_text() == "mine\n"


def test_a_two_lane_policy_passes_check_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "two.yaml"
    args = ["init", "--engine", "http://127.0.0.1:9101", "--engine", "http://127.0.0.1:9102"]
    args += ["--heavy-engine", "http://127.0.0.1:9201", "--threshold", "16384"]
    assert main([*args, "--max-model-len", "262144", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["check-config", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fast: 0 <= prompt tokens < 16384" in printed
    # The lanes stop 4096 tokens (the default --output-tokens) short of the context.
    assert "heavy: 16384 <= prompt tokens < 258048" in printed
    assert "max_model_len: 262144" in out.read_text()
    assert "chat_template: hf" in out.read_text()  # the model's own, what vLLM renders
    assert "warning" not in capsys.readouterr().err
    assert "slots: lane 128, per endpoint 64" in printed
    assert "# " in out.read_text()  # annotated


def test_init_leaves_room_for_the_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt that fills the context leaves the engine nothing to answer with: init's lanes
    end --output-tokens short of --max-model-len, so such a prompt is refused up front."""
    out = tmp_path / "one.yaml"
    args = ["init", "--engine", "http://127.0.0.1:9101", "--max-model-len", "32768"]
    assert main([*args, "--output-tokens", "1000", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["check-config", str(out)]) == 0
    assert "main: 0 <= prompt tokens < 31768" in capsys.readouterr().out
    assert main([*args, "--output-tokens", "32768", "--out", str(out), "--force"]) == 2
    assert "--output-tokens must lie between 0 and --max-model-len" in capsys.readouterr().err
    heavy = [*args, "--heavy-engine", "http://127.0.0.1:9201", "--threshold", "30000"]
    assert main([*heavy, "--out", str(out), "--force"]) == 2  # 30000 >= 32768 - 4096
    assert "--threshold must lie between 0 and 28672" in capsys.readouterr().err


async def test_init_then_serve_against_a_sim_engine(tmp_path: Path, counter: TokenCounter) -> None:
    """Every command ``init`` prints (and the reload command in the file's header), run exactly
    as printed through a shell, works."""
    out = tmp_path / "policy.yaml"
    shared = RegistryCounter(counter, "qwen3.6")
    port = free_port()
    env = shapegate_on_path(tmp_path)

    def shell(line: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", line],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=tmp_path,
            env=env,
        )

    async with run_sim("h100-fast", time_scale=0.01, seed=1, counter=shared) as engine:
        init = gateway_cli("init", "--engine", engine.url, "--port", str(port))
        init += ["--model", "qwen3.6", "--max-model-len", "32768", "--out", str(out)]
        made = await asyncio.to_thread(
            subprocess.run,
            init,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
            env=checkout_env(),
        )
        assert made.returncode == 0, made.stderr
        printed = {
            key: line.split(":", 1)[1].strip()
            for line in made.stdout.splitlines()
            for key in ("check", "serve", "reload")
            if line.startswith(f"  {key}:")
        }
        assert set(printed) == {"check", "serve", "reload"}, made.stdout
        header = [line[4:] for line in out.read_text().splitlines() if line.startswith("#   ")]
        expected = [f"shapegate check-config {out}", f"shapegate serve --config {out}"]
        assert header == [*expected, printed["reload"]], header
        checked = await asyncio.to_thread(shell, printed["check"])
        assert checked.returncode == 0, checked.stderr
        assert "main: 0 <= prompt tokens < 28672" in checked.stdout  # 4096 left for output
        log = (tmp_path / "serve.log").open("wb")
        proc = subprocess.Popen(  # the serve line as printed, until it is told to stop
            ["bash", "-c", "exec " + printed["serve"]],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                await until_ok(client, url + "/readyz")
                r = await client.post(url + "/v1/chat/completions", json=chat("hello there"))
                assert r.status_code == 200, r.text
                assert r.headers["x-shapegate-lane"] == "main"
                assert r.json()["choices"][0]["message"]["content"]
                version = (await client.get(url + "/admin/state")).json()["policy_version"]
                reloaded = await asyncio.to_thread(shell, printed["reload"], 60)
                assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr
                assert orjson.loads(reloaded.stdout)["version"] == version + 1
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, timeout=30)
            log.close()
        assert proc.returncode == 0, (tmp_path / "serve.log").read_text()
