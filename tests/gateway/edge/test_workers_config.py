"""``server.workers`` and ``serve --workers``: what check-config says and refuses, and which
slot store each worker of a group gets (gateway/edge/services.py ``build_store``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.edge.reload import diff_settings
from gateway.edge.services import build_store
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.settings import parse_settings
from gateway.slots.host import HostSlotStore, WorkerGroup
from gateway.slots.redis_store import RedisSlotStore
from gateway.slots.store import MemorySlotStore
from gateway.tools.cli import build_parser, main
from tests.conftest import lanes_config
from tests.gateway.test_config_check import GOOD


def test_check_config_says_who_keeps_the_slots_of_several_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD.replace("  boot_probe: false\n", "  boot_probe: false\n  workers: 4\n"))
    assert main(["check-config", str(path)]) == 0
    assert "workers: 4, slots kept by the supervisor's slot server" in capsys.readouterr().out
    path.write_text(GOOD)
    assert main(["check-config", str(path)]) == 0
    assert "workers:" not in capsys.readouterr().out  # one process: nothing to say


@pytest.mark.parametrize("count", [0, 65])
def test_check_config_refuses_a_worker_count_out_of_range(
    count: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(
        GOOD.replace("  boot_probe: false\n", f"  boot_probe: false\n  workers: {count}\n")
    )
    assert main(["check-config", str(path)]) == 2
    assert "server.workers" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "-1", "two", "65"])
def test_serve_refuses_a_bad_workers_option(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--config", "demo", "--workers", text])
    assert exit_info.value.code == 2
    assert "--workers: must be a whole number from 1 to 64" in capsys.readouterr().err


def test_the_worker_count_only_changes_on_restart() -> None:
    one = parse_settings(lanes_config(["http://e"], ["http://e"]), environ={})
    two = one.model_copy(update={"server": one.server.model_copy(update={"workers": 2})})
    assert diff_settings(one, two) == {"server.workers": {"old": 1, "new": 2}}
    from gateway.edge.reload import RESTART_ONLY

    assert "server.workers" in RESTART_ONLY


async def test_each_worker_gets_the_store_its_backend_and_group_call_for(tmp_path: Path) -> None:
    settings = parse_settings(lanes_config(["http://e"], ["http://e"]), environ={})
    metrics, log = Metrics(), get_logger("test")
    group = WorkerGroup(1, 3, tmp_path)
    assert isinstance(build_store(settings, metrics, log), MemorySlotStore)
    host = build_store(settings, metrics, log, group)
    assert isinstance(host, HostSlotStore) and host.shared
    redis = settings.model_copy(
        update={"state": settings.state.model_copy(update={"backend": "redis", "replicas": 2})}
    )
    store = build_store(redis, metrics, log, group)
    assert isinstance(store, RedisSlotStore)
    # fail_open_local splits each limit over every worker of every replica: 2 x 3.
    assert store._state.replicas == 6
    await store.aclose()


def test_a_worker_asking_a_peer_on_its_unix_socket_counts_as_loopback() -> None:
    from gateway.edge.admin.guard import AdminRequest, admin_access

    headers = [(b"host", b"localhost"), (b"x-shapegate-admin", b"1")]
    unix = {"path": "/admin/state", "method": "GET", "client": None, "headers": headers}
    peer = AdminRequest.from_scope({**unix, "server": ("/run/x/worker-1.sock", None)})
    assert peer.unix_socket and admin_access(peer, None).allow
    # No client address on TCP is not a unix socket: still refused without a token.
    unknown = AdminRequest.from_scope({**unix, "server": ("127.0.0.1", 8000)})
    assert not unknown.unix_socket and admin_access(unknown, None).status == 403


def test_workers_that_cannot_load_the_policy_stop_the_supervisor_with_exit_2(
    tmp_path: Path,
) -> None:
    from tests.gateway.test_config_check import BAD, line_of
    from tests.support.checkout import ROOT, checkout_env, gateway_cli
    from tests.support.servers import free_port

    edit, needle, message = BAD["unknown builtin tokenizer"]
    path = tmp_path / "policy.yaml"
    path.write_text(edit(GOOD))
    argv = gateway_cli("serve", "--config", str(path), "--workers", "2")
    proc = subprocess.run(
        [*argv, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env=checkout_env(),
    )
    assert proc.returncode == 2  # not restarted for ever
    assert f"{path}:{line_of(edit(GOOD), needle)}: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "workers.config_error" in proc.stdout + proc.stderr
