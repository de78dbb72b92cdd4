"""``dynamod --role planner`` as a real process, in ``--dry-run``, against real etcd and NATS, two
real mocker workers and a real frontend.

What an operator relies on: the planner shows in discovery (component ``planner``) with its status
under its lease; its decisions arrive on ``planner_decisions`` every interval with growing ids and
the pool's real worker count, and never act under dry-run; the traffic it reports is what the
frontend served (scraped from the frontend's own ``/metrics``, found through discovery); a
``dynamoctl scale`` override shows in the next decision at once; SIGTERM takes it out of discovery.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.events.plane import TOPIC_PLANNER_DECISIONS
from dynamod.shared.protocol.instance import decode_instance
from dynamod.shared.protocol.keys import instances_prefix, planner_override_key, planner_status_key
from dynamod.shared.protocol.planner import (
    PLANNER_COMPONENT,
    PlannerDecision,
    PlannerStatus,
    ScaleOverride,
    decision_decoder,
)
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import EtcdServer, NatsServer, free_port, poll, wait_until
from tests.integration.frontend.test_frontend_support import CLI, Proc, clean_env, get_json, get_text

pytestmark = pytest.mark.timeout(180)

NS = "plannertest"
INTERVAL_S = 1.0


class Cluster:
    """etcd, NATS, two agg mocker workers, a frontend and a dry-run planner."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.etcd = EtcdServer().start()
        self.nats = NatsServer().start()
        self.env = clean_env(root / "unused-file-kv")
        self.procs: list[Proc] = []
        self.http_port = free_port()
        self.planner_port = free_port()
        self.planner: Proc | None = None

    def flags(self) -> list[str]:
        return ["--namespace", NS, "--discovery-backend", "etcd", "--etcd-endpoints", self.etcd.endpoint,
                "--event-plane", "nats", "--nats-server", self.nats.url, "--lease-ttl", "3"]

    def settings(self) -> RuntimeSettings:
        return RuntimeSettings(namespace=NS, discovery_backend="etcd", etcd_endpoints=[self.etcd.endpoint],
                               event_plane="nats", nats_server=self.nats.url, lease_ttl_s=3.0)

    def start(self) -> None:
        for i in range(2):
            self.procs.append(Proc(f"worker-{i}", [*CLI, "--role", "agg", "--engine", "mocker", "--model", "tiny",
                                                   "--speedup-ratio", "20", *self.flags()], self.env, self.root))
        self.procs.append(Proc("frontend", [*CLI, "--role", "frontend", "--http-port", str(self.http_port),
                                            "--worker-wait", "5", *self.flags()], self.env, self.root))
        self.planner = Proc("planner", [*CLI, "--role", "planner", "--planner", "load", "--mode", "agg",
                                        "--adjustment-interval", str(INTERVAL_S), "--min-endpoint", "1", "--dry-run",
                                        "--system-port", str(self.planner_port), *self.flags()], self.env, self.root)
        self.procs.append(self.planner)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def planner_metric(self, name: str) -> float | None:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", get_text(f"http://127.0.0.1:{self.planner_port}/metrics"), re.M)
        return float(match.group(1)) if match else None

    def ready_workers(self) -> int:
        models = get_json(self.url + "/health").get("models", [])
        return sum(1 for m in models if m["model"] == "tiny" for w in m["workers"] if w["status"] == "ready")

    def check_alive(self) -> None:
        for proc in self.procs:
            if not proc.alive() and proc is not self.planner:
                raise AssertionError(f"{proc.name} exited:\n{proc.log()}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.nats.cleanup()
        self.etcd.cleanup()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("planner-role"))
    try:
        c.start()

        def ready() -> bool:
            c.check_alive()
            return c.ready_workers() >= 2

        wait_until(ready, 60, interval=0.1, what="the frontend to see two ready workers")
        yield c
    finally:
        c.stop()


@pytest.fixture
async def runtime(cluster: Cluster) -> AsyncIterator[DistributedRuntime]:
    rt = await DistributedRuntime.create(cluster.settings())
    yield rt
    await rt.shutdown(grace_s=0)


class Decisions:
    """The ``planner_decisions`` stream, collected in the background."""

    def __init__(self) -> None:
        self.items: list[PlannerDecision] = []

    async def collect(self, rt: DistributedRuntime) -> asyncio.Task[None]:
        sub = await rt.namespace(NS).component(PLANNER_COMPONENT).subscribe(TOPIC_PLANNER_DECISIONS)

        async def run() -> None:
            try:
                async for msg in sub:
                    self.items.append(decision_decoder.decode(msg.payload))
            finally:
                await sub.close()

        return asyncio.create_task(run())


async def test_decisions_on_the_event_plane_and_status_in_discovery(cluster: Cluster, runtime: DistributedRuntime) -> None:
    decisions = Decisions()
    task = await decisions.collect(runtime)
    try:
        async def three() -> list[PlannerDecision] | None:
            agg = [d for d in decisions.items if d.pool == "agg" and d.current == 2]
            return agg if len({d.decision_id for d in agg}) >= 3 else None

        agg = await poll(three, 30, "three planner passes over the agg pool")
    finally:
        task.cancel()
    ids = [d.decision_id for d in agg]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(d.namespace == NS and d.planner == "load" and d.component == "backend" for d in agg)
    assert all(d.dry_run and not d.acted and not d.error for d in agg)
    assert all(d.min_replicas == 1 and d.reason for d in agg)
    assert {d.pool for d in decisions.items} == {"agg"}  # --mode agg plans one pool

    raw = await runtime.store.get(planner_status_key(NS))
    assert raw is not None
    status = msgspec.json.decode(raw, type=PlannerStatus)
    assert status.planner == "load" and status.dry_run and status.interval_s == INTERVAL_S
    assert status.pools["agg"].current == 2 and status.last_decision_id >= ids[-1]
    instances = [decode_instance(v) for v in (await runtime.store.get_prefix(instances_prefix(NS, PLANNER_COMPONENT))).values()]
    assert [(i.endpoint, i.instance_id, i.role) for i in instances] == [("status", status.instance_id, "planner")]
    health = get_json(f"http://127.0.0.1:{cluster.planner_port}/health")
    assert health["status"] == "ready"
    assert cluster.planner_metric('dynamo_planner_current_replicas{pool="agg"}') == 2


async def stream_load(url: str) -> None:
    """Streaming requests (the frontend times inter-token gaps of streams), one after another,
    until cancelled."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        i = 0
        while True:
            body = {"model": "tiny", "prompt": f"hello planner {i}", "max_tokens": 8, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for _line in resp.aiter_lines():
                    pass
            i += 1


async def test_traffic_is_scraped_from_the_frontend(cluster: Cluster) -> None:
    def gauges() -> dict[str, float]:
        names = ("requests_per_second", "ttft_ms", "itl_ms", "input_sequence_tokens", "output_sequence_tokens")
        return {n: cluster.planner_metric(f"dynamo_planner_observed_{n}") or 0.0 for n in names}

    # A pass differences the frontend's counters since the previous one: under load, every figure shows.
    async def observed() -> dict[str, float] | None:
        if sender.done():
            sender.result()  # the load generator failed: say why
        g = gauges()
        return g if all(v > 0 for v in g.values()) else None

    sender = asyncio.create_task(stream_load(cluster.url))
    try:
        g = await poll(observed, 15, "the planner to observe the frontend's streams")
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    assert g["output_sequence_tokens"] == pytest.approx(8)
    assert g["ttft_ms"] < 5000 and g["itl_ms"] < 1000


async def test_override_shows_in_the_next_decision_at_once(cluster: Cluster, runtime: DistributedRuntime) -> None:
    decisions = Decisions()
    task = await decisions.collect(runtime)
    key = planner_override_key(NS, "agg")
    try:
        await runtime.store.put(key, msgspec.json.encode(ScaleOverride(replicas=3, set_by="ops@test", reason="load test")))

        async def overridden() -> PlannerDecision | None:
            return next((d for d in decisions.items if d.reason == "override"), None)

        d = await poll(overridden, 10, "a decision carrying the override")
        assert (d.pool, d.desired, d.override, d.current, d.action) == ("agg", 3, 3, 2, "scale_up")
        assert not d.acted and d.dry_run and "ops@test" in d.detail
    finally:
        await runtime.store.delete(key)
        task.cancel()


async def test_sigterm_leaves_discovery(cluster: Cluster, runtime: DistributedRuntime) -> None:
    assert cluster.planner is not None
    assert cluster.planner.stop(timeout=15) == 0
    assert await runtime.store.get(planner_status_key(NS)) is None
    assert await runtime.store.get_prefix(instances_prefix(NS, PLANNER_COMPONENT)) == {}
    log = cluster.planner.log()
    assert "planner stopped" in log and "Traceback" not in log


async def test_sla_planner_plans_from_the_frontends_traffic(cluster: Cluster, runtime: DistributedRuntime) -> None:
    """After the load planner left: an SLA planner sizes the agg pool from the traffic it scrapes."""
    planner = Proc("planner-sla", [*CLI, "--role", "planner", "--planner", "sla", "--mode", "agg",
                                   "--adjustment-interval", str(INTERVAL_S), "--load-predictor", "constant",
                                   "--dry-run", *cluster.flags()], cluster.env, cluster.root)
    decisions = Decisions()
    task = await decisions.collect(runtime)
    sender = asyncio.create_task(stream_load(cluster.url))
    try:
        async def planned() -> PlannerDecision | None:
            if not planner.alive():
                raise AssertionError(f"the SLA planner exited:\n{planner.log()}")
            if sender.done():
                sender.result()
            return next((d for d in decisions.items if d.planner == "sla" and d.inputs.get("request_rate", 0) > 0
                         and "ttft_ms" in d.inputs), None)

        d = await poll(planned, 20, "an SLA decision from measured traffic")
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        task.cancel()
        assert planner.stop(timeout=15) == 0
    assert (d.pool, d.current, d.dry_run, d.acted) == ("agg", 2, True, False)
    assert d.targets == {"ttft_ms": 500.0, "itl_ms": 50.0}
    assert d.inputs["osl"] == pytest.approx(8) and d.inputs["itl_ms"] > 0
    assert d.min_replicas == 1 and d.desired >= 1
