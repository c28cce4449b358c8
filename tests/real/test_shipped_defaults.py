"""The counts hold with the defaults an operator starts from, not only with the tier's policy.

``shapegate init`` pointed at the two real engines writes a policy; served as written, its
gateway must count the chat corpus as vLLM does. The same for the tokenizer settings of every
shipped policy (configs/*.yaml, deploy/compose.policy.yaml), served in front of the real engines:
a template that differs from the model's own (defect 7: ``chatml``) shows here as a table."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.real.corpus import CORPUS
from tests.real.engines import MAX_MODEL_LEN, THRESHOLD, Gateway, Real, gateway_env
from tests.real.test_exact_count import measure, mismatched, table
from tests.support.checkout import ROOT, gateway_cli
from tests.support.servers import free_port

# The categories that exercise the template itself (the other defects have their own tests).
TEMPLATE_CATEGORIES = {
    "plain",
    "system",
    "multi_turn",
    "tools",
    "cjk",
    "code",
    "json",
    "thinking",
    "continue_final",
}
SHIPPED = [*sorted((ROOT / "configs").glob("*.yaml")), ROOT / "deploy" / "compose.policy.yaml"]


@contextmanager
def serving(config: dict[str, Any], root: Path, name: str) -> Iterator[Gateway]:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = int(config["server"]["port"])
    gateway = Gateway(f"http://127.0.0.1:{port}", path, root / f"{name}.log")
    gateway.start()
    try:
        started = time.monotonic()
        while not gateway.ready():
            assert time.monotonic() - started < 180, f"{name} never ready:\n{gateway.tail()}"
            time.sleep(0.2)
        yield gateway
    finally:
        gateway.stop()


def mismatches(real: Real, gateway: Gateway) -> list[dict[str, Any]]:
    view = Real(gateway, real.fast, real.heavy, real.policy, real.model_dir, real.boot_s)
    cases = [c for c in CORPUS if c.category in TEMPLATE_CATEGORIES]
    with httpx.Client(timeout=60) as client:
        rows = [measure(view, client, case) for case in cases]
    return [r for r in rows if mismatched(r)]


def test_a_policy_from_shapegate_init_counts_as_vllm_does(real: Real, tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "shapegate.yaml"
    done = subprocess.run(
        gateway_cli(
            "init",
            "--engine",
            real.fast.url,
            "--heavy-engine",
            real.heavy.url,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--threshold",
            str(THRESHOLD),
            "--port",
            str(port),
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=gateway_env(),
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(out.read_text())
    config["server"]["host"] = "127.0.0.1"
    with serving(config, tmp_path, "init") as gateway:
        bad = mismatches(real, gateway)
    template = config["models"][0]["tokenizer"].get("chat_template")
    assert not bad, (
        f"with `shapegate init`'s policy (chat_template {template}), {len(bad)} requests "
        f"are counted differently from vLLM:\n{table(bad)}"
    )


def shipped_tokenizers() -> dict[str, list[str]]:
    """Each distinct tokenizer setting of the shipped policies -> the files that use it."""
    found: dict[str, list[str]] = {}
    for path in SHIPPED:
        for model in yaml.safe_load(path.read_text()).get("models", []):
            key = yaml.safe_dump(model["tokenizer"], sort_keys=True)
            found.setdefault(key, []).append(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize(
    "spec",
    sorted(shipped_tokenizers()),
    ids=lambda s: str(yaml.safe_load(s).get("chat_template", "default")),
)
def test_the_shipped_policies_tokenizer_counts_as_vllm_does(
    real: Real, tmp_path: Path, spec: str
) -> None:
    config = dict(real.policy)
    config["server"] = {**config["server"], "port": free_port()}
    config["models"] = [{**config["models"][0], "tokenizer": yaml.safe_load(spec)}]
    with serving(config, tmp_path, "shipped") as gateway:
        bad = mismatches(real, gateway)
    files = ", ".join(shipped_tokenizers()[spec])
    assert not bad, (
        f"with the tokenizer of {files} ({spec.strip()}), {len(bad)} requests are counted "
        f"differently from vLLM:\n{table(bad)}"
    )
