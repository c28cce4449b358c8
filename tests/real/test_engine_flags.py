"""The vLLM 0.32.0 flag table (engine_pool/engine_flags.py) against the installed release, and
the servers of the tier started from what ``shapegate launch-command`` renders."""

from __future__ import annotations

import os
import re
import subprocess

from engine_pool.engine_flags import KNOWN_FLAGS
from tests.real.engines import ENGINE_ENV, VLLM_VERSION, Real


def test_every_flag_of_the_0_32_0_row_is_accepted_by_the_installed_vllm(
    vllm_python: str,
) -> None:
    version = subprocess.run(
        [vllm_python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout.strip()
    assert version.startswith(VLLM_VERSION), version
    shown = subprocess.run(
        [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--help=all"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        env={**os.environ, **ENGINE_ENV},
    ).stdout
    accepted = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", shown))
    missing = sorted(KNOWN_FLAGS[("vllm", VLLM_VERSION)] - accepted)
    assert not missing, f"vLLM {version} does not accept {missing}"


def test_the_servers_run_the_rendered_command(real: Real) -> None:
    for name, engine in real.engines.items():
        argv = engine.argv
        assert argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"], argv
        assert argv[4] == str(real.model_dir)
        flags = dict(zip(argv, [*argv[1:], None], strict=True))
        assert flags["--port"] == str(engine.port), name
        assert flags["--max-model-len"] == "8192"
        assert flags["--max-num-seqs"] == "8"
        assert "--enable-force-include-usage" in argv
