"""The planner loop with a scripted policy and a recording connector at its edges, and a real
in-memory discovery store for overrides and status.

What an operator relies on: a ``dynamoctl scale`` override wins over the policy and is carried out
at once; ``--dry-run`` never touches the fleet; every decision is published with an id that all
pools of one pass share and that grows pass by pass; a failing connector is reported in the
decision and asked again next pass, and the planner keeps running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.planner.loop import LoopSettings, OverrideWatch, PlannerLoop
from dynamod.daemon.planner.metrics import PlannerMetrics
from dynamod.daemon.planner.policy import Observation, PoolObservation, PoolPlan
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import UnavailableError
from dynamod.shared.protocol.keys import planner_override_key, planner_status_key
from dynamod.shared.protocol.planner import (
    ACTION_HOLD,
    ACTION_SCALE_DOWN,
    ACTION_SCALE_UP,
    PlannerDecision,
    PlannerStatus,
    ScaleOverride,
    decision_decoder,
    decision_encoder,
)

NS = "test"


class ScriptedPolicy:
    """Answers each pass with the next scripted desired counts; records what it was asked."""

    name = "load"

    def __init__(self, *answers: dict[str, int], interval_s: float = 3600.0) -> None:
        self.interval_s = interval_s
        self._answers = list(answers)
        self.calls: list[Observation] = []
        self.fail = False

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        self.calls.append(observation)
        if self.fail:
            raise RuntimeError("policy bug")
        answer = self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]
        plans = {}
        for pool, desired in answer.items():
            ready = observation.pools[pool].ready
            action = ACTION_SCALE_UP if desired > ready else ACTION_SCALE_DOWN if desired < ready else ACTION_HOLD
            plans[pool] = PoolPlan(pool, desired, action, "scripted", f"script says {desired}",
                                   inputs={"kv_usage": 0.5}, predicted={"request_rate": 2.0})
        return plans


class RecordingConnector:
    name = "virtual"

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, int], int]] = []
        self.started = 0
        self.failures = 0  # the next N calls raise

    async def start(self) -> None:
        self.started += 1

    async def ready_replicas(self) -> dict[str, int]:
        return {}

    async def set_replicas(self, desired: dict[str, int], decision_id: int) -> None:
        if self.failures:
            self.failures -= 1
            raise UnavailableError("orchestrator unreachable")
        self.calls.append((dict(desired), decision_id))

    async def close(self) -> None:
        return None


class Harness:
    def __init__(self, store: MemStore, policy: ScriptedPolicy, connector: RecordingConnector | None, *, dry_run: bool) -> None:
        self.store = store
        self.policy = policy
        self.connector = connector
        self.ready = {"prefill": 1, "decode": 2, "agg": 0}
        self.published: list[PlannerDecision] = []
        self.traffic_sampled = 0
        self.registry = CollectorRegistry()
        self.overrides = OverrideWatch(store, NS)
        self.loop = PlannerLoop(
            policy,
            observe=self.observe,
            overrides=self.overrides,
            publish=self.publish,
            write_status=self.write_status,
            connector=connector,
            settings=LoopSettings(namespace=NS, dry_run=dry_run, connector_name="virtual", instance_id=0xABC),
            metrics=PlannerMetrics(self.registry),
            first_decision_id=7,
        )

    async def observe(self, with_traffic: bool) -> Observation:
        self.traffic_sampled += with_traffic
        return Observation(now=0.0, pools={p: PoolObservation(pool=p, ready=n) for p, n in self.ready.items()})

    async def publish(self, decision: PlannerDecision) -> None:
        # Through the wire codec, as a subscriber would read it.
        self.published.append(decision_decoder.decode(decision_encoder.encode(decision)))

    async def write_status(self, status: PlannerStatus) -> None:
        await self.store.put(planner_status_key(NS), msgspec.json.encode(status))

    async def status(self) -> PlannerStatus:
        raw = await self.store.get(planner_status_key(NS))
        assert raw is not None
        return msgspec.json.decode(raw, type=PlannerStatus)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


@pytest.fixture
async def store() -> AsyncIterator[MemStore]:
    s = MemStore()
    await s.start()
    yield s
    await s.close()


async def make(store: MemStore, *answers: dict[str, int], dry_run: bool = False,
               connector: RecordingConnector | None = None) -> Harness:
    h = Harness(store, ScriptedPolicy(*answers), connector if connector is not None else RecordingConnector(), dry_run=dry_run)
    await h.overrides.start()
    return h


async def set_override(store: MemStore, pool: str, replicas: int) -> None:
    await store.put(planner_override_key(NS, pool), msgspec.json.encode(ScaleOverride(replicas=replicas, set_by="ops@test")))


async def wait_for(predicate, timeout: float = 5.0) -> None:
    """Polls ``predicate`` until it holds; fails after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if predicate():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting for a condition")
        await asyncio.sleep(0.01)


async def test_decisions_are_published_per_pool_with_one_id_per_pass(store: MemStore) -> None:
    h = await make(store, {"prefill": 2, "decode": 2}, {"prefill": 2, "decode": 1})
    try:
        first = await h.loop.tick()
        h.ready["prefill"] = 2  # the scale-up landed
        second = await h.loop.tick()
    finally:
        await h.overrides.close()
    assert [(d.decision_id, d.pool) for d in h.published] == [(7, "prefill"), (7, "decode"), (8, "prefill"), (8, "decode")]
    assert h.published == [*first, *second]
    up, hold = first
    assert (up.current, up.desired, up.action, up.reason) == (1, 2, ACTION_SCALE_UP, "scripted")
    assert up.acted and not up.error and up.inputs == {"kv_usage": 0.5} and up.predicted == {"request_rate": 2.0}
    assert (hold.action, hold.acted) == (ACTION_HOLD, True)  # asked for the first time: the connector learns the count
    assert (second[1].desired, second[1].action, second[1].acted) == (1, ACTION_SCALE_DOWN, True)
    assert (second[0].action, second[0].acted) == (ACTION_HOLD, False)  # the connector already has 2
    assert h.connector is not None and h.connector.calls == [({"prefill": 2, "decode": 2}, 7), ({"prefill": 2, "decode": 1}, 8)]
    status = await h.status()
    assert status.last_decision_id == 8 and status.instance_id == 0xABC and status.connector == "virtual"
    assert {p: (s.current, s.desired) for p, s in status.pools.items()} == {"prefill": (2, 2), "decode": (2, 1)}
    assert status.predicted == {"request_rate": 2.0}
    assert h.metric("dynamo_planner_desired_replicas", pool="decode") == 1
    assert h.metric("dynamo_planner_current_replicas", pool="prefill") == 2
    assert h.metric("dynamo_planner_decisions_total", pool="decode", action=ACTION_SCALE_DOWN) == 1
    assert h.metric("dynamo_planner_predicted_requests_per_second") == 2.0


async def test_override_wins_over_the_policy(store: MemStore) -> None:
    await set_override(store, "decode", 5)
    h = await make(store, {"prefill": 1, "decode": 1})
    try:
        prefill, decode = await h.loop.tick()
    finally:
        await h.overrides.close()
    assert (decode.desired, decode.override, decode.reason, decode.action) == (5, 5, "override", ACTION_SCALE_UP)
    assert "ops@test" in decode.detail and "policy wanted 1" in decode.detail
    assert (prefill.desired, prefill.reason, prefill.override) == (1, "scripted", None)
    assert h.connector is not None and h.connector.calls == [({"prefill": 1, "decode": 5}, 7)]
    assert (await h.status()).pools["decode"].override == 5
    assert h.metric("dynamo_planner_override_replicas", pool="decode") == 5


async def test_an_override_for_a_pool_the_policy_does_not_plan_is_still_carried_out(store: MemStore) -> None:
    await set_override(store, "agg", 2)
    h = await make(store, {"decode": 2})
    try:
        decisions = await h.loop.tick()
    finally:
        await h.overrides.close()
    assert [(d.pool, d.desired, d.reason) for d in decisions] == [("decode", 2, "scripted"), ("agg", 2, "override")]


async def test_override_set_between_intervals_is_carried_out_at_once_without_the_policy(store: MemStore) -> None:
    h = await make(store, {"prefill": 1, "decode": 2})
    stop = asyncio.Event()
    runner = asyncio.create_task(h.loop.run(stop))  # interval one hour: only the override can wake it
    try:
        await set_override(store, "decode", 4)
        await wait_for(lambda: len(h.published) == 1)
        [d] = h.published
        assert (d.pool, d.desired, d.reason, d.decision_id, d.acted) == ("decode", 4, "override", 7, True)
        assert h.policy.calls == [] and h.traffic_sampled == 0  # no off-schedule sample for the predictors
        # Clearing it changes nothing until the policy's next pass decides.
        await store.delete(planner_override_key(NS, "decode"))
        await wait_for(lambda: not h.overrides.current())
        await asyncio.sleep(0)
        assert len(h.published) == 1
    finally:
        stop.set()
        await asyncio.wait_for(runner, 5)
        await h.overrides.close()


async def test_dry_run_never_calls_the_connector(store: MemStore) -> None:
    await set_override(store, "prefill", 3)
    h = await make(store, {"prefill": 2, "decode": 4}, dry_run=True)
    try:
        await h.loop.start_connector()
        decisions = await h.loop.tick()
        decisions += await h.loop.tick()
    finally:
        await h.overrides.close()
    assert h.connector is not None and h.connector.calls == [] and h.connector.started == 0
    assert all(d.dry_run and not d.acted and not d.error for d in decisions)
    assert [(d.pool, d.desired) for d in decisions[:2]] == [("prefill", 3), ("decode", 4)]
    assert (await h.status()).dry_run


async def test_connector_failure_is_published_and_retried_next_pass(store: MemStore) -> None:
    connector = RecordingConnector()
    connector.failures = 1
    h = await make(store, {"prefill": 1, "decode": 3}, connector=connector)
    try:
        failed = await h.loop.tick()
        retried = await h.loop.tick()
    finally:
        await h.overrides.close()
    assert all("orchestrator unreachable" in d.error and not d.acted for d in failed)
    assert h.metric("dynamo_planner_connector_errors_total") == 1
    assert all(not d.error for d in retried) and retried[1].acted
    assert connector.calls == [({"prefill": 1, "decode": 3}, 8)]


async def test_a_policy_that_raises_holds_and_the_planner_goes_on(store: MemStore) -> None:
    h = await make(store, {"prefill": 1, "decode": 2})
    h.policy.fail = True
    try:
        decisions = await h.loop.tick()
        h.policy.fail = False
        after = await h.loop.tick()
    finally:
        await h.overrides.close()
    assert {(d.pool, d.desired, d.action, d.reason) for d in decisions} == {
        ("prefill", 1, ACTION_HOLD, "policy_error"), ("decode", 2, ACTION_HOLD, "policy_error")}
    assert [d.reason for d in after] == ["scripted", "scripted"]


async def test_malformed_or_unknown_overrides_are_ignored(store: MemStore) -> None:
    await store.put(planner_override_key(NS, "decode"), b"{not json")
    await store.put(planner_override_key(NS, "gpu"), msgspec.json.encode(ScaleOverride(replicas=3)))
    h = await make(store, {"prefill": 1, "decode": 2})
    try:
        decisions = await h.loop.tick()
    finally:
        await h.overrides.close()
    assert [(d.pool, d.reason) for d in decisions] == [("prefill", "scripted"), ("decode", "scripted")]
