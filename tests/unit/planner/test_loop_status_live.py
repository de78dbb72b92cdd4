"""The planner's status record carries the live figures the console and ``dynamoctl planner
status`` show (issue 24 item 14): the traffic it measured over its last interval and each pool's
queued/running requests and KV usage, read back from a real in-memory store."""

from __future__ import annotations

import msgspec

from dynamod.daemon.planner.loop import LoopSettings, OverrideWatch, PlannerLoop
from dynamod.daemon.planner.policy import Observation, PoolObservation, PoolPlan, TrafficSample, WorkerLoad
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.protocol.keys import planner_override_key, planner_status_key
from dynamod.shared.protocol.planner import PlannerStatus, ScaleOverride

NS = "test"


class HoldPolicy:
    name = "load"
    interval_s = 3600.0

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        return {pool: PoolPlan(pool, p.ready) for pool, p in observation.pools.items()}


def _load(wid: int, kv: float, waiting: int, running: int) -> WorkerLoad:
    return WorkerLoad(worker_id=wid, kv_usage=kv, num_waiting=waiting, num_running=running,
                      active_prefill_tokens=0, active_decode_blocks=0, total_blocks=100)


async def test_status_carries_the_intervals_traffic_and_pool_load() -> None:
    store = MemStore()
    traffic: list[TrafficSample | None] = [
        TrafficSample(duration_s=2.0, num_requests=9.0, isl=512.0, osl=None, ttft_ms=850.0, itl_ms=21.0),
        None,  # the next interval's source failed: nothing measured
    ]

    async def observe(with_traffic: bool) -> Observation:
        sample = traffic.pop(0) if with_traffic else None
        pools = {"agg": PoolObservation(pool="agg", ready=2, loads=(_load(1, 0.94, 5, 4), _load(2, 0.10, 0, 1)))}
        return Observation(now=0.0, pools=pools, traffic=sample)

    async def write_status(status: PlannerStatus) -> None:
        await store.put(planner_status_key(NS), msgspec.json.encode(status))

    async def publish(_d: object) -> None:
        return None

    overrides = OverrideWatch(store, NS)
    await overrides.start()
    loop = PlannerLoop(HoldPolicy(), observe=observe, overrides=overrides, publish=publish, write_status=write_status,
                       connector=None, settings=LoopSettings(namespace=NS, dry_run=True))

    async def status() -> PlannerStatus:
        raw = await store.get(planner_status_key(NS))
        assert raw is not None
        return msgspec.json.decode(raw, type=PlannerStatus)

    try:
        await loop.tick()
        st = await status()
        # 9 arrivals in 2 s; OSL was not measured, so it is absent rather than 0.
        assert st.observed == {"request_rate": 4.5, "isl": 512.0, "ttft_ms": 850.0, "itl_ms": 21.0}
        assert st.pools["agg"].load == {"waiting": 5.0, "running": 5.0, "kv_usage": 0.94}
        assert st.pools["agg"].action == "hold"

        # An override-only pass samples no traffic: the last interval's figures stay.
        await store.put(planner_override_key(NS, "agg"), msgspec.json.encode(ScaleOverride(replicas=3)))
        await overrides.changed.wait()
        overrides.changed.clear()
        await loop.tick(plan=False)
        st = await status()
        assert st.observed["request_rate"] == 4.5 and st.pools["agg"].load["waiting"] == 5.0

        # A planned interval with no traffic sample: stale figures are not shown as live.
        await loop.tick()
        assert (await status()).observed == {}
    finally:
        await overrides.close()
