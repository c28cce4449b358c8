"""Endpoints found by DNS: each cluster with ``discovery`` has its name re-resolved on an
interval, and the gateway's endpoints follow the answer.

Contract:
- ``run_discovery(gateway)`` runs until cancelled, one watcher per cluster with ``discovery``
  (settings.DiscoverySettings). It resolves at once, then every ``interval_s`` (the interval and
  name in force at each turn, so a reload changes them).
- A change of the address set is logged once (``discovery.changed``: added, removed, count) and
  applied through the reload path (gateway/edge/reload.py ``apply_reload``) with the found
  endpoints after the policy's static ones (settings.with_discovered): an address that appears
  joins DOWN ("joined, not probed yet"), its prober brings it UP once a probe passes and it then
  slow-starts over ``outlier.slow_start_s`` (engine_pool/registry.py); one that vanishes leaves
  routing at once and its in-flight requests run to their end.
- A failed lookup (timeout, DNS error) keeps the endpoints as they are: it is logged and
  counted as swallowed (``discovery.resolve``, decision ``kept_endpoints``). An empty answer
  (NXDOMAIN, no A records) is an answer: the discovered endpoints go.
"""

from __future__ import annotations

import anyio

from gateway.edge.reload import apply_reload
from gateway.edge.services import Gateway
from gateway.observe.log import swallowed
from gateway.settings import ClusterSettings, DiscoverySettings
from gateway.upstream.dns import DnsError, resolve_a, system_nameserver


async def run_discovery(gateway: Gateway) -> None:
    names = [c.name for c in gateway.settings.clusters if c.discovery is not None]
    async with anyio.create_task_group() as watchers:
        for name in names:
            watchers.start_soon(_watch, gateway, name)


def _current(gateway: Gateway, name: str) -> ClusterSettings | None:
    for cluster in gateway.settings.clusters:
        if cluster.name == name:
            return cluster
    return None


def _server(discovery: DiscoverySettings) -> tuple[str, int]:
    if discovery.nameserver is None:
        return system_nameserver()
    host, _, port = discovery.nameserver.rpartition(":")
    return host, int(port)


async def _watch(gateway: Gateway, name: str) -> None:
    while True:
        cluster = _current(gateway, name)
        if cluster is None or cluster.discovery is None:
            return  # a reload removed the cluster or its discovery
        discovery = cluster.discovery
        try:
            addresses = await resolve_a(discovery.name, _server(discovery), discovery.timeout_s)
        except (DnsError, OSError) as exc:
            swallowed(
                gateway.log, gateway.metrics, "discovery.resolve", exc, decision="kept_endpoints"
            )
        else:
            urls = tuple(f"{discovery.scheme}://{a}:{discovery.port}" for a in addresses)
            await _adopt(gateway, cluster, urls)
        await anyio.sleep(discovery.interval_s)


async def _adopt(gateway: Gateway, cluster: ClusterSettings, urls: tuple[str, ...]) -> None:
    old = gateway.discovered.get(cluster.name, ())
    if set(urls) == set(old):
        return
    added = sorted(set(urls) - set(old))
    removed = sorted(set(old) - set(urls))
    assert cluster.discovery is not None
    gateway.log.info(
        "discovery.changed",
        cluster=cluster.name,
        name=cluster.discovery.name,
        added=added,
        removed=removed,
        endpoints=len(urls),
    )
    # The policy without the endpoints found before: apply_reload adds the new ones.
    base = gateway.settings.model_copy(
        update={
            "clusters": tuple(
                c.model_copy(update={"endpoints": tuple(u for u in c.endpoints if u not in old)})
                if c.name == cluster.name
                else c
                for c in gateway.settings.clusters
            )
        }
    )
    gateway.discovered[cluster.name] = urls
    await apply_reload(gateway, base)
