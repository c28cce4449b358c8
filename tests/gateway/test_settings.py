from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config_check import load_settings
from gateway.settings import ConfigError, parse_settings
from gateway.tools.cli import main
from tests.conftest import lanes_config

ROOT = Path(__file__).resolve().parents[2]


def test_every_shipped_config_loads() -> None:
    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert files
    for path in files:
        settings = load_settings(path, environ={})
        assert settings.lanes


def test_unknown_keys_are_errors_with_the_path() -> None:
    config = lanes_config(["http://a"], ["http://b"])
    config["lanes"][0]["max_promt_tokens"] = 5
    with pytest.raises(ConfigError, match=r"lanes\.0\.max_promt_tokens"):
        parse_settings(config, environ={})
    with pytest.raises(ConfigError, match="surprise"):
        parse_settings({**config, "surprise": 1}, environ={})


def test_environment_overrides_nested_keys() -> None:
    config = lanes_config(["http://a"], ["http://b"])
    env = {"SHAPEGATE_STATE__BACKEND": "redis", "SHAPEGATE_SERVER__PORT": "9123", "OTHER": "x"}
    settings = parse_settings(config, environ=env)
    assert settings.state.backend == "redis" and settings.server.port == 9123
    with pytest.raises(ConfigError, match="backend"):
        parse_settings(config, environ={"SHAPEGATE_STATE__BACKEND": "etcd"})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["lanes"][0].update(clusters=["nope"]), "unknown cluster 'nope'"),
        (lambda c: c["lanes"][1].update(min_prompt_tokens=1000), "overlap: lanes"),
        (lambda c: c["lanes"][1].update(min_prompt_tokens=3000), "gap: no lane takes"),
        (lambda c: c["clusters"][0].update(endpoints=["ftp://x"]), "not an http"),
        (lambda c: c["lanes"][0].update(min_prompt_tokens=5000), "min_prompt_tokens"),
        (lambda c: c["lanes"][0].update(on_full="spill"), "on_full"),
        (lambda c: c["lanes"][0]["slots"].update(lane=0), "slots.lane"),
        (lambda c: c["lanes"][1].update(new_home_slack=1.5), "new_home_slack"),
        (lambda c: c["lanes"][1].update(new_home_slack=-0.1), "new_home_slack"),
    ],
)
def test_invalid_policies_are_refused(mutate: object, message: str) -> None:
    config = lanes_config(["http://a"], ["http://b"])
    mutate(config)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=message):
        parse_settings(config, environ={})


def test_settings_are_frozen() -> None:
    settings = parse_settings(lanes_config(["http://a"], ["http://b"]), environ={})
    with pytest.raises(ValueError, match="frozen"):
        settings.lanes[0].max_prompt_tokens = 1  # type: ignore[misc]


def test_check_config_prints_the_effective_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "configs" / "demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "fast: 0 <= prompt tokens < 32768" in out
    assert "heavy: 32768 <= prompt tokens < 1048576" in out
    assert "slots: lane 8, per endpoint 4" in out


def test_check_config_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("lanes: [}\n")
    assert main(["check-config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == 2
