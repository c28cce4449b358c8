"""A minimal DNS client: the IPv4 addresses (A records) of one name, asked of one server.

``await resolve_a(name, server, timeout_s)`` sends one standard query over UDP (RFC 1035, 4.1)
and returns the answer's A records, sorted, de-duplicated; ``DnsError`` on a timeout, a
truncated or malformed answer, or an error code other than NXDOMAIN (which answers ``()``: the
name has no addresses now). CNAME chains in the answer are followed by taking every A record
the server put there, as a recursive resolver's answer holds the whole chain.

Written here rather than taken from a library because discovery needs one query type from one
configured server (e.g. a cluster's DNS service), and the whole of it fits in this file.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import struct
from pathlib import Path

_A, _IN = 1, 1
_NXDOMAIN = 3


class DnsError(Exception):
    pass


def system_nameserver(resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, int]:
    """The first ``nameserver`` of resolv.conf, port 53."""
    for line in resolv_conf.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            return parts[1], 53
    raise DnsError(f"no nameserver in {resolv_conf}")


def query(name: str, ident: int) -> bytes:
    header = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0)  # recursion desired
    labels = b"".join(
        bytes([len(part)]) + part.encode("ascii") for part in name.rstrip(".").split(".")
    )
    return header + labels + b"\0" + struct.pack(">HH", _A, _IN)


def _skip_name(data: bytes, at: int) -> int:
    while True:
        if at >= len(data):
            raise DnsError("truncated name")
        length = data[at]
        if length & 0xC0 == 0xC0:  # a compression pointer ends the name
            return at + 2
        if length == 0:
            return at + 1
        at += 1 + length


def parse_answer(data: bytes, ident: int) -> tuple[str, ...]:
    if len(data) < 12:
        raise DnsError("short answer")
    got, flags, questions, answers, _, _ = struct.unpack(">HHHHHH", data[:12])
    if got != ident or not flags & 0x8000:
        raise DnsError("not the answer to our query")
    if flags & 0x0200:
        raise DnsError("truncated answer (TC)")
    code = flags & 0x000F
    if code == _NXDOMAIN:
        return ()
    if code != 0:
        raise DnsError(f"DNS error code {code}")
    at = 12
    for _ in range(questions):
        at = _skip_name(data, at) + 4
    found = set()
    for _ in range(answers):
        at = _skip_name(data, at)
        if at + 10 > len(data):
            raise DnsError("truncated record")
        kind, klass, _, length = struct.unpack(">HHIH", data[at : at + 10])
        at += 10
        if kind == _A and klass == _IN and length == 4:
            found.add(str(ipaddress.IPv4Address(data[at : at + 4])))
        at += length
    return tuple(sorted(found, key=ipaddress.IPv4Address))


class _Reply(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if not self.answer.done():
            self.answer.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


async def resolve_a(name: str, server: tuple[str, int], timeout_s: float) -> tuple[str, ...]:
    ident = secrets.randbelow(1 << 16)
    loop = asyncio.get_running_loop()
    transport, reply = await loop.create_datagram_endpoint(_Reply, remote_addr=server)
    try:
        transport.sendto(query(name, ident))
        try:
            async with asyncio.timeout(timeout_s):
                data = await reply.answer
        except TimeoutError:
            raise DnsError(f"no answer from {server[0]}:{server[1]} in {timeout_s:g}s") from None
        except OSError as exc:
            raise DnsError(f"{server[0]}:{server[1]}: {exc}") from exc
    finally:
        transport.close()
    return parse_answer(data, ident)
