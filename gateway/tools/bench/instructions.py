"""``shapegate bench shadow --instructions``: what a shadow policy costs a request, counted in
instructions rather than seconds (issue 34's "at most 3% CPU per request").

Method. The real gateway (``shapegate serve``, the overhead rig's policy and upstream) runs
under ``valgrind --tool=callgrind``, which counts the instructions every thread of the process
executes. Small chat requests (the overhead bench's JSON body) go one at a time, each waiting
for its answer, so the count does not depend on timing. Each window is ``--ir-requests``
requests after ``--ir-warm`` unmeasured ones in the same mode (the first request of a mode
imports and fills what later ones reuse): ``callgrind_control --zero`` before it,
``callgrind_control --dump`` after it, the dump's total is the window's instructions, boot and
warm-up excluded. Windows alternate off, on, off, on (``POST``/``DELETE /admin/shadow`` between
them, outside the windows). Background work (health probes and load scrapes, set to an hour
here; the event loop's idle ticks) runs by the clock, not by the request: an idle window as long
as the last request window is counted too and reported as a share, to show it is negligible.
Figures: instructions per request off and on, and their ratio (the on windows' sum over the off
windows'). The verdict is named for what it counts: instructions, not CPU seconds; cache misses,
branch mispredictions and frequency are not in it, and the wall-clock CPU ratio of the overhead
rounds stays reported beside it. Callgrind's counts repeat run to run within a few parts in
ten thousand (the two windows of a mode show it), so 3% is resolved by one run.

The memo. The shadow decides once for alike requests it decides with ``decide``
(``request/shadow_live.py``: the key is the exact figure, the endpoints' views with their
in-flight counts, the class inputs). These small requests are the common case
``shadow.decide_now`` decides at once, reading no memo, so both runs count a decision for every
request. ``memo=False`` starts the gateway with ``shadow_live.MEMO_MAX = 0``: nothing is kept,
every request is decided afresh, the cost where the memo never hits (varied or concurrent
traffic), whichever way it is decided.

Requires ``valgrind`` (with ``callgrind_control``) on PATH; ``available()`` says whether it is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.tools.bench.harness import Child, free_port, gateway_policy, start_upstream, wait_http
from gateway.tools.bench.overhead import BODIES, PATH

ADMIN = {"content-type": "application/yaml", "x-shapegate-admin": "1"}
BOOT_S = 600.0  # the gateway's start under callgrind (its imports run ~50x slower)
QUIET_S = 3600.0  # probe and scrape intervals during the measurement: none in a window
_TOTALS = re.compile(rb"^(?:totals|summary):\s*(\d+)", re.MULTILINE)


def available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def _quiet(policy: dict[str, Any]) -> dict[str, Any]:
    """The rig's policy with health probes and load scrapes an hour apart."""
    for lane in policy["lanes"]:
        lane["health"] = {"interval_s": QUIET_S, "scrape_interval_s": QUIET_S}
    return policy


class _Counted:
    """The gateway under callgrind, and its dumps read one window at a time."""

    def __init__(self, child: Child, out: Path) -> None:
        self.child, self.out, self.dumps = child, out, 0

    def _control(self, flag: str) -> None:
        subprocess.run(  # noqa: S603 - valgrind's own tool, the pid of our child
            ["callgrind_control", flag, str(self.child.pid)],  # noqa: S607 - found on PATH
            check=True,
            capture_output=True,
            timeout=120,
        )

    def zero(self) -> None:
        self._control("--zero")

    def dump(self) -> int:
        """Dump the counts since the last zero or dump; their total instructions."""
        self._control("--dump")
        self.dumps += 1
        path = Path(f"{self.out}.{self.dumps}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.is_file():
                found = _TOTALS.search(path.read_bytes())
                if found is not None:
                    return int(found.group(1))
            time.sleep(0.1)
        raise RuntimeError(f"no callgrind dump at {path}")


def _send(client: httpx.Client, url: str, n: int) -> None:
    for _ in range(n):
        answer = client.post(
            url + PATH, content=BODIES["json"], headers={"content-type": "application/json"}
        )
        if answer.status_code != 200:
            raise RuntimeError(f"request failed: {answer.status_code} {answer.text}")


# ``shapegate serve`` with the shadow's memo keeping nothing (``memo=False``): the same command,
# the module constant set before the app is made (``ShadowLive`` reads it then).
_SERVE_NO_MEMO = (
    "import sys; import gateway.request.shadow_live as s; s.MEMO_MAX = 0; "
    "from gateway.tools.cli import main; sys.exit(main(['serve', *sys.argv[1:]]))"
)


def instructions(
    requests: int, warm: int, candidate: Callable[[dict[str, Any]], str], memo: bool = True
) -> dict[str, Any]:
    """Instructions per request with the shadow off and on (see the module docstring);
    ``candidate`` makes the shadow policy (YAML) from the rig's policy; ``memo=False``: every
    request decided afresh."""
    with tempfile.TemporaryDirectory(prefix="shapegate-bench-ir-") as tmp:
        folder = Path(tmp)
        upstream, upstream_port = start_upstream(folder, None)
        gateway: Child | None = None
        try:
            port = free_port()
            policy = _quiet(gateway_policy(upstream_port, port))
            shadow = candidate(_quiet(gateway_policy(upstream_port, port)))
            config = folder / "gateway.yaml"
            config.write_text(yaml.safe_dump(policy), encoding="utf-8")
            out = folder / "callgrind.out"
            argv = [
                "env",
                "PYTHONHASHSEED=0",  # the same dict and set layouts in every run
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                "--dump-line=no",
                "--compress-strings=no",
                sys.executable,
                *(("-m", "gateway.tools.cli", "serve") if memo else ("-c", _SERVE_NO_MEMO)),
                "--config",
                str(config),
            ]
            gateway = Child.start("gateway", argv, folder / "gateway.log", None)
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/readyz", gateway, BOOT_S)
            counted = _Counted(gateway, out)
            windows: list[dict[str, Any]] = []
            compared = 0
            with httpx.Client(timeout=120) as client:
                for mode in ("off", "on", "off", "on"):
                    if mode == "on":
                        started = client.post(url + "/admin/shadow", content=shadow, headers=ADMIN)
                        started.raise_for_status()
                    _send(client, url, warm)
                    counted.zero()
                    began = time.monotonic()
                    _send(client, url, requests)
                    total = counted.dump()
                    seconds = time.monotonic() - began
                    if mode == "on":
                        stopped = client.delete(url + "/admin/shadow", headers=ADMIN)
                        stopped.raise_for_status()
                        compared += stopped.json()["report"]["compared"] - warm
                    windows.append(
                        {"mode": mode, "instructions": total, "seconds": round(seconds, 2)}
                    )
                counted.zero()
                time.sleep(windows[-1]["seconds"])
                idle = counted.dump()
        finally:
            if gateway is not None:
                gateway.stop()
            upstream.stop()
    per = {
        mode: sum(w["instructions"] for w in windows if w["mode"] == mode)
        / (requests * sum(1 for w in windows if w["mode"] == mode))
        for mode in ("off", "on")
    }
    mean_window = sum(w["instructions"] for w in windows) / len(windows)
    return {
        "method": "callgrind instruction counts of the whole gateway process (every thread), "
        "requests one at a time, windows zeroed and dumped with callgrind_control; "
        "off, on, off, on",
        "memo": "kept" if memo else "none (MEMO_MAX = 0): every request decided afresh",
        "requests": requests,
        "warm": warm,
        "windows": windows,
        "shadow_compared": compared,
        "instructions_per_request": {m: round(v) for m, v in per.items()},
        "instruction_ratio": round(per["on"] / per["off"], 4),
        "idle_instructions": idle,
        "idle_share": round(idle / mean_window, 5),
        "valgrind": _version(),
    }


def pair_ratios(windows: list[dict[str, Any]]) -> list[float]:
    """Each (off, on) pair of windows' on/off ratio, in order: how far apart two runs of the
    same count land (a garbage collection falls in one window and not the other)."""
    off = [w["instructions"] for w in windows if w["mode"] == "off"]
    on = [w["instructions"] for w in windows if w["mode"] == "on"]
    return [round(b / a, 4) for a, b in zip(off, on, strict=True)]


def _version() -> str:
    found = subprocess.run(
        ["valgrind", "--version"],  # noqa: S607 - found on PATH
        check=True,
        capture_output=True,
        text=True,
    )
    return found.stdout.strip()
