"""Outages under load, with real servers and processes: NATS stopped (routers go approximate and
resync from the workers when it is back), etcd stopped for 30 s (serving goes on with the known
instances; a drain sent meanwhile takes effect when it returns; everything is registered again),
one of two frontends killed (the other keeps serving). Every test proves that no request was lost
or silently cut short: each one asks for an exact number of tokens and must get all of them."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.chaos.outage_support import ServerCluster, StreamLoad
from tests.fixtures.servers import EtcdServer, NatsServer, wait_until
from tests.integration.frontend.test_frontend_support import get_text

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` (whose label text contains ``labels``) on ``url``/metrics."""
    total = 0.0
    for line in get_text(url + "/metrics").splitlines():
        m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def explained(url: str, prompt: str) -> tuple[str, int, int]:
    """One unary completion: (worker instance id, overlap blocks the router credited, cached tokens)."""
    r = httpx.post(url + "/v1/completions", headers={"x-dynamo-route-explain": "1"}, timeout=30,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    explain = json.loads(r.headers["x-dynamo-route-explain"])
    cached = r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return r.headers["x-dynamo-worker-instance-id"], int(explain["overlap_blocks"]), int(cached)


@pytest.fixture
def cluster(tmp_path: Path, etcd_server: EtcdServer, nats_server: NatsServer) -> Iterator[ServerCluster]:
    c = ServerCluster(tmp_path, etcd_server, nats_server, lease_ttl=5.0, speedup=10.0)
    try:
        yield c
    finally:
        c.stop()


def test_nats_outage_routes_approximately_then_resyncs_from_the_workers(cluster: ServerCluster, nats_server: NatsServer) -> None:
    for _ in range(2):
        cluster.start_worker("--block-size", "16")
    cluster.start_frontend("--router-mode", "kv")
    cluster.wait_ready(2)
    ok_resyncs = 'outcome="ok"'
    wait_until(lambda: metric(cluster.url, "dynamo_router_kv_resyncs_total", ok_resyncs) >= 2, 20, what="first kv_dump reads")
    prompt = "outage prompt: " + " ".join(f"word{i}" for i in range(160))
    with StreamLoad(cluster.url, concurrency=3, max_tokens=16) as load:
        load.wait_for(3, since=0.0, timeout=30)
        nats_server.stop()
        down = time.monotonic()
        wait_until(lambda: metric(cluster.url, "dynamo_router_kv_events_outage") == 1, 15, what="the frontend to notice NATS is gone")
        # First seen during the outage: the worker's KV events about it are lost. Routing
        # remembers where it sent it, so the repeat goes there and hits the worker's cache.
        worker, overlap, _ = explained(cluster.url, prompt)
        assert overlap == 0
        again, overlap, cached = explained(cluster.url, prompt)
        assert again == worker and overlap > 0 and cached > 0
        load.wait_for(6, since=down, timeout=30)  # serving goes on without the event plane
        resyncs = metric(cluster.url, "dynamo_router_kv_resyncs_total", ok_resyncs)
        nats_server.start()
        wait_until(lambda: metric(cluster.url, "dynamo_router_kv_events_outage") == 0, 30, what="the frontend to reconnect")
        wait_until(lambda: metric(cluster.url, "dynamo_router_kv_resyncs_total", ok_resyncs) >= resyncs + 2, 30,
                   what="every worker's cache re-read")
        # The guesses are gone; what the router knows now it read from the workers' caches.
        third, overlap, cached = explained(cluster.url, prompt)
        assert third == worker and overlap > 0 and cached > 0
        up = time.monotonic()
        load.wait_for(3, since=up, timeout=30)
    outcomes = load.stop()
    assert outcomes and all(o.ok for o in outcomes), load.summary()
    assert metric(cluster.url, "dynamo_router_kv_events_outages_total") == 1


def test_etcd_outage_of_30s_keeps_serving_applies_a_drain_sent_meanwhile_and_reregisters(
    cluster: ServerCluster, etcd_server: EtcdServer
) -> None:
    for _ in range(2):
        cluster.start_worker()
    cluster.start_frontend()
    workers = cluster.wait_ready(2)
    drained = workers[0]
    with StreamLoad(cluster.url, concurrency=4, max_tokens=16) as load:
        load.wait_for(4, since=0.0, timeout=30)
        etcd_server.stop()
        down = time.monotonic()
        # The operator drains a worker while etcd is away: the worker takes no new requests at
        # once and writes its status when etcd answers again.
        reply = drain_over_request_plane(cluster, drained)
        assert reply["status"] == "ok", reply
        load.wait_for(8, since=down, timeout=40)  # serving goes on with the instances known
        remaining = 30.0 - (time.monotonic() - down)
        if remaining > 0:
            time.sleep(remaining)  # the outage itself is the scenario, not a synchronization
        etcd_server.start()
        wait_until(lambda: drained not in cluster.ready_workers(), 30, what="the drain to reach discovery")
        seen = time.monotonic()  # the frontend's own view says draining from here on
        load.wait_for(4, since=seen, timeout=30)
    outcomes = load.stop()
    assert outcomes and all(o.ok for o in outcomes), load.summary()
    late = [o for o in outcomes if o.started >= seen]
    assert late and all(o.worker != drained for o in late), "a drained worker got new requests"
    health = cluster.health()
    statuses = {i["instance_id"]: i["status"] for i in health["instances"] if i["endpoint"] == "generate"}
    assert statuses == {drained: "draining", workers[1]: "ready"}, statuses


def drain_over_request_plane(cluster: ServerCluster, instance_hex: str) -> dict:
    """``drain`` sent straight to the worker's control endpoint at the address the frontend knows
    (discovery is down, so ``dynamoctl`` could not look it up): the same request dynamoctl sends."""
    import asyncio

    from dynamod.shared.config import DEFAULT_NAMESPACE
    from dynamod.shared.protocol import control
    from dynamod.shared.transport.plane import ServerAddress
    from dynamod.shared.transport.tcp_client import TcpRequestClient

    address = next(i["address"] for i in cluster.health()["instances"] if i["instance_id"] == instance_hex)
    worker_id = int(instance_hex, 16)

    async def call() -> dict:
        client = TcpRequestClient()
        try:
            path = f"{DEFAULT_NAMESPACE}/backend/{control.DRAIN}/{worker_id:x}"
            stream = client.stream(ServerAddress("tcp", address), path, {}, timeout_s=10)
            return [item async for item in stream][0]
        finally:
            await client.close()

    return asyncio.run(call())
