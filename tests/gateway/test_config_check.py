"""check-config runs what serve runs at boot, and reload refuses the same policies, each problem
named once at its file and line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.config_check import load_policy, parse_policy
from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.settings import ConfigError
from gateway.tools.cli import main
from tests.conftest import ADMIN
from tests.support.servers import serve_asgi

GOOD = """\
server:
  boot_probe: false
models:
  - name: qwen3.6
    tokenizer: {source: builtin, name: qwen3.6, chat_template: chatml}
    max_model_len: 1048576
clusters:
  - name: fast
    endpoints: [http://127.0.0.1:9]
  - name: heavy
    endpoints: [http://127.0.0.1:9]
lanes:
  - name: fast
    max_prompt_tokens: 4096
    clusters: [fast]
    slots: {lane: 8, per_endpoint: 8}
  - name: heavy
    min_prompt_tokens: 4096
    max_prompt_tokens: 1048576
    clusters: [heavy]
    slots: {lane: 2, per_endpoint: 2}
"""

# name -> (edit of GOOD, the text of the offending line, what the message must say)
BAD: dict[str, tuple[Callable[[str], str], str, str]] = {
    "lane gap": (
        lambda t: t.replace("min_prompt_tokens: 4096", "min_prompt_tokens: 8192"),
        "min_prompt_tokens: 8192",
        "lanes.1.min_prompt_tokens: gap: no lane takes prompts of 4096 to 8191 tokens",
    ),
    "lane overlap": (
        lambda t: t.replace("min_prompt_tokens: 4096", "min_prompt_tokens: 2048"),
        "min_prompt_tokens: 2048",
        "lanes.1.min_prompt_tokens: overlap: lanes 'fast' and 'heavy' both take prompts of "
        "2048 to 4095",
    ),
    "unknown key": (
        lambda t: t.replace("max_prompt_tokens: 4096", "max_promt_tokens: 4096"),
        "max_promt_tokens: 4096",
        "lanes.0.max_promt_tokens: unknown key (did you mean 'max_prompt_tokens'?)",
    ),
    "unknown builtin tokenizer": (
        lambda t: t.replace("name: qwen3.6, chat", "name: llama3, chat"),
        "name: llama3",
        "models.0.tokenizer: model 'qwen3.6': unknown builtin tokenizer 'llama3'",
    ),
    "missing chat template": (
        lambda t: t.replace(
            "name: qwen3.6, chat_template: chatml", "name: cl100k_base, chat_template: hf"
        ),
        "chat_template: hf",
        "models.0.tokenizer.chat_template: model 'qwen3.6': chat_template hf, but no chat template",
    ),
    "unset env var": (
        lambda t: t.replace(
            "    endpoints: [http://127.0.0.1:9]\n  - name: heavy",
            "    endpoints: [http://127.0.0.1:9]\n    api_key_env: CHECK_TEST_ENGINE_KEY\n"
            "  - name: heavy",
        ),
        "api_key_env: CHECK_TEST_ENGINE_KEY",
        "clusters.0.api_key_env: environment variable CHECK_TEST_ENGINE_KEY is not set",
    ),
    "per_endpoint above the lane limit": (
        lambda t: t.replace(
            "slots: {lane: 2, per_endpoint: 2}", "slots: {lane: 2, per_endpoint: 4}"
        ),
        "per_endpoint: 4",
        "lanes.1.slots.per_endpoint: 4 is above the lane's limit (slots.lane) of 2",
    ),
    "tracing protocol": (
        lambda t: t + "tracing:\n  enabled: true\n  protocol: zipkin\n",
        "protocol: zipkin",
        "tracing.protocol: Input should be 'http/protobuf' or 'grpc'",
    ),
    "tracing sample ratio": (
        lambda t: t + "tracing:\n  sample_ratio: 1.5\n",
        "sample_ratio: 1.5",
        "tracing.sample_ratio: Input should be less than or equal to 1",
    ),
    "tracing unknown key": (
        lambda t: t + "tracing:\n  sample_rate: 0.5\n",
        "sample_rate: 0.5",
        "tracing.sample_rate: unknown key (did you mean 'sample_ratio'?)",
    ),
    "sentinel password from an unset env var": (
        lambda t: (
            t + "state:\n  backend: redis\n  sentinel:\n    hosts: ['127.0.0.1:26379']\n"
            "    master_name: main\n    password_env: CHECK_TEST_REDIS_PASSWORD\n"
        ),
        "password_env: CHECK_TEST_REDIS_PASSWORD",
        "state.sentinel.password_env: environment variable CHECK_TEST_REDIS_PASSWORD is not set",
    ),
    "sentinel host without a port": (
        lambda t: t + "state:\n  sentinel:\n    hosts: [sentinel-0]\n    master_name: main\n",
        "hosts: [sentinel-0]",
        "state.sentinel.hosts: sentinel host 'sentinel-0' is not host:port",
    ),
    "multipart lane that is no lane": (
        lambda t: t + "routes:\n  multipart_lane: audio\n",
        "multipart_lane: audio",
        "routes.multipart_lane: unknown lane 'audio' (lanes: fast, heavy)",
    ),
}


def line_of(text: str, needle: str) -> int:
    (number,) = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return number


@pytest.mark.parametrize("case", list(BAD))
def test_check_config_names_the_file_line_and_key(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, needle, message = BAD[case]
    text = edit(GOOD)
    assert text != GOOD
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line_of(text, needle)}: {message}" in err, err
    assert "(1 problem)" in err  # one message per problem, nothing spurious


def test_the_good_policy_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    assert main(["check-config", str(path)]) == 0
    assert "heavy: 4096 <= prompt tokens < 1048576" in capsys.readouterr().out


def test_a_template_other_than_the_models_own_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect 7: counting must follow the engine, which renders the model's own template. A
    policy that renders another one passes with a warning; ``hf`` and the default (``auto``:
    the model's own when its tokenizer ships one) pass clean."""
    path = tmp_path / "policy.yaml"
    quick = GOOD + "counting: {warmup_tokens: 0}\n"  # the warning, not the warm-up, is tested
    for template, warned in (("chatml", True), ("none", True), ("hf", False), (None, False)):
        line = "" if template is None else f", chat_template: {template}"
        path.write_text(quick.replace(", chat_template: chatml", line))
        assert main(["check-config", str(path)]) == 0
        err = capsys.readouterr().err
        assert ("its tokenizer ships its own chat template" in err) is warned, (template, err)
        if warned:
            assert f"model 'qwen3.6' renders chat prompts with chat_template {template!r}" in err
    # A tokenizer with no template of its own (cl100k): ChatML is all there is, no warning.
    cl100k = "{source: tiktoken_encoding, name: cl100k_base}"
    path.write_text(
        quick.replace("{source: builtin, name: qwen3.6, chat_template: chatml}", cl100k)
    )
    assert main(["check-config", str(path)]) == 0
    assert "chat template" not in capsys.readouterr().err


def test_the_default_template_is_the_models_own() -> None:
    own = TokenCounter.for_models(
        [
            {"name": "q", "tokenizer": {"source": "builtin", "name": "qwen3.6"}},
            {"name": "c", "tokenizer": {"source": "tiktoken_encoding", "name": "cl100k_base"}},
        ]
    )
    try:
        assert (own.template_of("q"), own.template_of("c")) == ("hf", "chatml")
    finally:
        own.close()


def test_a_tracing_section_passes_and_needs_the_otel_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.observe.tracing import missing_extra

    traced = GOOD + (
        "tracing:\n  enabled: true\n  protocol: grpc\n  endpoint: http://collector:4317\n"
        "  service_name: gw-eu\n  sample_ratio: 0.1\n  headers: {api-key: k}\n"
    )
    path = tmp_path / "policy.yaml"
    path.write_text(traced)
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    settings = parse_policy(traced, "p.yaml", environ={}).settings.tracing
    assert missing_extra(settings) is None  # installed with [dev]
    gone = missing_extra(settings, find=lambda name: None if "grpc" in name else object())
    assert gone is not None and "pip install 'shapegate[otel]'" in gone
    assert "opentelemetry.exporter.otlp.proto.grpc" in gone


def test_a_bad_model_entry_is_one_problem_not_two() -> None:
    # pydantic also reports "models: Tuple should have at least 1 item" here: a consequence.
    text = GOOD.replace("    max_model_len: 1048576", "    max_model_len: 1048576\n    bogus: 1")
    with pytest.raises(ConfigError) as caught:
        parse_policy(text, "p.yaml", environ={})
    message = str(caught.value)
    assert "(1 problem)" in message and "Tuple" not in message
    assert f"p.yaml:{line_of(text, 'bogus')}: models.0.bogus: unknown key; known keys:" in message


def test_every_problem_is_listed_at_once() -> None:
    text = BAD["lane gap"][0](GOOD).replace("lane: 8, per_endpoint: 8", "lane: 8, per_endpoint: 9")
    with pytest.raises(ConfigError, match=r"\(2 problems\)") as caught:
        parse_policy(text, "p.yaml", environ={})
    assert "lanes.1.min_prompt_tokens: gap" in str(caught.value)
    assert "lanes.0.slots.per_endpoint: 9 is above" in str(caught.value)


def test_an_env_override_is_named_by_its_variable() -> None:
    overridden = {"SHAPEGATE_STATE__BACKEND": "etcd"}
    with pytest.raises(ConfigError, match=r"p\.yaml: environment SHAPEGATE_STATE__BACKEND: state"):
        parse_policy(GOOD, "p.yaml", environ=overridden)


def test_set_env_vars_pass() -> None:
    text = BAD["unset env var"][0](GOOD)
    policy = parse_policy(text, "p.yaml", environ={"CHECK_TEST_ENGINE_KEY": "k"})
    assert policy.settings.clusters[0].api_key_env == "CHECK_TEST_ENGINE_KEY"
    auth = GOOD + "auth: {api_keys_env: CHECK_TEST_CLIENT_KEYS}\n"
    with pytest.raises(ConfigError, match=r"auth\.api_keys_env: environment variable"):
        parse_policy(auth, "p.yaml", environ={})


async def test_reload_refuses_each_and_keeps_serving(
    tmp_path: Path, counter: TokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CHECK_TEST_ENGINE_KEY", raising=False)
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    policy = load_policy(path, environ={})
    app = create_app(policy.settings, counter, config_path=path)
    async with serve_asgi(app) as url, httpx.AsyncClient(timeout=30) as client:
        for case, (edit, needle, message) in BAD.items():
            text = edit(GOOD)
            line = line_of(text, needle)
            # POST /admin/reload with the policy in the body ...
            r = await client.post(url + "/admin/reload", content=text, headers=ADMIN)
            assert r.status_code == 400, case
            assert f"request body:{line}: {message}" in r.json()["error"]["message"], case
            # ... and the file re-read (what SIGHUP and the file watch do, too).
            path.write_text(text)
            r = await client.post(url + "/admin/reload", headers=ADMIN)
            assert r.status_code == 400, case
            assert f"{path}:{line}: {message}" in r.json()["error"]["message"], case
        state = (await client.get(url + "/admin/state")).json()
        assert state["policy_version"] == 1
        path.write_text(GOOD.replace("lane: 8, per_endpoint: 8", "lane: 6, per_endpoint: 6"))
        assert (await client.post(url + "/admin/reload", headers=ADMIN)).status_code == 200
        assert (await client.get(url + "/admin/state")).json()["policy_version"] == 2


def test_emergency_clusters_must_serve_the_lanes_models() -> None:
    text = GOOD.replace(
        "  - name: heavy\n    endpoints: [http://127.0.0.1:9]\n",
        "  - name: heavy\n    endpoints: [http://127.0.0.1:9]\n"
        "  - name: spare\n    endpoints: [http://127.0.0.1:9]\n    models: [small]\n",
    ).replace(
        "    clusters: [heavy]\n",
        "    clusters: [heavy]\n    emergency_clusters: [spare]\n",
    )
    small = "  - name: small\n    tokenizer: {source: builtin, name: qwen3.6}\n"
    text = text.replace("clusters:\n  - name: fast", small + "clusters:\n  - name: fast")
    with pytest.raises(ConfigError) as caught:
        parse_policy(text, "p.yaml", environ={})
    line = line_of(text, "emergency_clusters: [spare]")
    assert f"p.yaml:{line}: lanes.1.emergency_clusters: no emergency cluster serves qwen3.6" in str(
        caught.value
    )
    served = text.replace("    models: [small]\n", "")
    assert parse_policy(served, "p.yaml", environ={}).settings.lanes[1].emergency_clusters


def test_serve_refuses_what_check_config_refuses_without_a_traceback(tmp_path: Path) -> None:
    edit, needle, message = BAD["unknown builtin tokenizer"]
    path = tmp_path / "policy.yaml"
    path.write_text(edit(GOOD))
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.tools.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert f"{path}:{line_of(edit(GOOD), needle)}: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
