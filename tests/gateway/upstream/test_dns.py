"""The minimal DNS client against a real dnsmasq: A records sorted and de-duplicated, NXDOMAIN
as no addresses, a silent server as a DnsError within the timeout; malformed answers refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.upstream.dns import DnsError, parse_answer, query, resolve_a, system_nameserver
from tests.support.dnsmasq import dnsmasq, free_udp_port
from tests.support.waiting import wait_for


async def test_a_records_and_nxdomain_from_a_real_server(tmp_path: Path) -> None:
    with dnsmasq(tmp_path) as dns:
        server = ("127.0.0.1", dns.port)
        dns.set_hosts({"engines.test": ["127.0.0.12", "127.0.0.3", "127.0.0.12"]})
        dns.reload()

        async def answer() -> tuple[str, ...]:
            return await resolve_a("engines.test", server, 1.0)

        assert await wait_for(answer, 5) == ("127.0.0.3", "127.0.0.12")
        assert await resolve_a("nothing.test", server, 1.0) == ()


async def test_a_silent_server_is_an_error_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(DnsError):
        await resolve_a("engines.test", ("127.0.0.1", free_udp_port()), 0.3)
    assert time.monotonic() - started < 1.0


def test_malformed_or_foreign_answers_are_refused() -> None:
    asked = query("engines.test", 7)
    with pytest.raises(DnsError, match="short"):
        parse_answer(b"\x00\x07", 7)
    with pytest.raises(DnsError, match="not the answer"):
        parse_answer(asked, 7)  # the query itself: no response bit
    truncated = asked[:2] + b"\x83\x00" + asked[4:]  # a response with TC set
    with pytest.raises(DnsError, match="truncated"):
        parse_answer(truncated, 7)


def test_the_system_nameserver_is_the_first_in_resolv_conf(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# comment\nsearch svc\nnameserver 10.96.0.10\nnameserver 8.8.8.8\n")
    assert system_nameserver(conf) == ("10.96.0.10", 53)
