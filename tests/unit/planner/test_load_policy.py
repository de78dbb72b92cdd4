"""The load planner: Dynamo's easy-mode thresholds, one step per interval, grace, budget."""

from __future__ import annotations

import pytest

from dynamod.daemon.planner.load_policy import LoadPolicy, LoadPolicyConfig, ReplicaBudget
from dynamod.daemon.planner.policy import Observation, PoolObservation, WorkerLoad
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.planner import ACTION_HOLD, ACTION_SCALE_DOWN, ACTION_SCALE_UP


def worker(wid: int, *, blocks: int = 0, running: int = 0, waiting: int = 0, prefill: int = 0, total: int = 100) -> WorkerLoad:
    return WorkerLoad(worker_id=wid, kv_usage=blocks / total, num_waiting=waiting, num_running=running,
                      active_prefill_tokens=prefill, active_decode_blocks=blocks, total_blocks=total)


def agg(now: float, *loads: WorkerLoad, ready: int | None = None) -> Observation:
    return Observation(now=now, pools={"agg": PoolObservation("agg", len(loads) if ready is None else ready, loads)})


def policy(**kw: object) -> LoadPolicy:
    cfg: dict[str, object] = dict(mode="agg", interval_s=5.0, grace_period_s=60.0)
    cfg.update(kw)
    return LoadPolicy(LoadPolicyConfig(**cfg))  # type: ignore[arg-type]


def test_scale_up_when_any_worker_over_demand() -> None:
    # 90 held blocks, 9 running -> 10 per request; 2 waiting -> 20 queued: (90 + 20) / 100 = 1.1 > 1.0
    plan = policy().plan(agg(0, worker(0, blocks=90, running=9, waiting=2), worker(1, blocks=10, running=1)))["agg"]
    assert (plan.desired, plan.action, plan.reason) == (3, ACTION_SCALE_UP, "kv_usage_high")
    assert "1.100" in plan.detail and plan.inputs["num_waiting"] == 2


def test_exactly_at_throughput_threshold_holds() -> None:
    # Dynamo compares decode utilisation with a strict ">" for the throughput/latency targets.
    plan = policy().plan(agg(0, worker(0, blocks=100, running=10)))["agg"]
    assert plan.action == ACTION_HOLD


def test_scale_down_when_all_under_and_survivors_fit_after_the_release_window() -> None:
    # Was: down at the first low reading. A worker costs a start-up to bring back, so the pool
    # shrinks only after evidence that the smaller fleet sufficed: a window of 10 x 10 s start-up,
    # of which a planner just started needs a third (35 s with the interval it decides on).
    p = policy(startup_s=10.0)
    low = (worker(0, blocks=20, running=2), worker(1, blocks=10, running=1), worker(2, blocks=0))
    plan = p.plan(agg(0, *low))["agg"]
    assert (plan.desired, plan.action, plan.reason) == (3, ACTION_HOLD, "release_window")
    for t in range(5, 30, 5):
        assert p.plan(agg(t, *low))["agg"].action == ACTION_HOLD
    plan = p.plan(agg(30, *low))["agg"]
    assert plan.action == ACTION_SCALE_DOWN and plan.desired < 3


def test_consolidation_guard_keeps_a_worker_the_survivor_could_not_carry() -> None:
    # 0.55 < 0.6 on both, but one worker alone would carry 0.55 * 2 / 1 = 1.1 >= 1.0
    plan = policy().plan(agg(0, worker(0, blocks=55, running=5), worker(1, blocks=55, running=5)))["agg"]
    assert (plan.desired, plan.reason) == (2, "consolidation_guard")


def test_never_under_min_and_at_min_holds() -> None:
    p = policy(budget=ReplicaBudget(decode_min=2))
    assert p.plan(agg(0, worker(0), worker(1)))["agg"].reason == "at_min"
    plan = policy(budget=ReplicaBudget(decode_min=2)).plan(agg(0, worker(0)))["agg"]
    assert (plan.desired, plan.reason) == (2, "below_min")


def test_max_replicas_and_gpu_budget_cap_scale_up() -> None:
    hot = worker(0, blocks=100, running=10, waiting=5)
    plan = policy(budget=ReplicaBudget(max_replicas=2)).plan(agg(0, hot, worker(1, blocks=100, running=10, waiting=5)))["agg"]
    assert (plan.desired, plan.reason, plan.action) == (2, "at_max_budget", ACTION_HOLD)
    plan = policy(budget=ReplicaBudget(max_gpu_budget=4, decode_engine_num_gpu=2)).plan(agg(0, hot, hot))["agg"]
    assert plan.desired == 2 and plan.reason == "at_max_budget"


def test_grace_period_holds_the_target_until_ready_or_expired() -> None:
    p = policy(grace_period_s=30.0)
    hot = worker(0, blocks=100, running=10, waiting=5)
    assert p.plan(agg(0, hot))["agg"].desired == 2
    held = p.plan(agg(5, hot))["agg"]  # the new worker is not ready yet: keep asking for 2, no third
    assert (held.desired, held.reason, held.action) == (2, "grace_period", ACTION_HOLD)
    # ready reached the target: decide again from the load
    assert p.plan(agg(10, hot, hot))["agg"].desired == 3
    # the third never comes: after the grace the policy decides afresh
    assert p.plan(agg(20, hot, hot))["agg"].reason == "grace_period"
    assert p.plan(agg(41, hot, hot))["agg"].reason == "kv_usage_high"


def test_prefill_queue_ratio_needs_context_length() -> None:
    p = LoadPolicy(LoadPolicyConfig(mode="disagg", optimization_target="latency"))
    obs = Observation(now=0, pools={
        "prefill": PoolObservation("prefill", 1, (worker(0, prefill=150),)),
        "decode": PoolObservation("decode", 1, (worker(1, blocks=20, running=2),)),
    })
    # Without the context length the queue ratio cannot be read, but the queued tokens still
    # count (was: the pool held with "insufficient_data", and queued requests never counted).
    assert p.plan(obs)["prefill"].reason != "queue_high"
    p = LoadPolicy(LoadPolicyConfig(mode="disagg", optimization_target="latency"))
    p.set_model(context_length=1000, kv_block_size=16)
    plans = p.plan(obs)
    assert (plans["prefill"].desired, plans["prefill"].reason) == (2, "queue_high")  # 150 / 1000 >= 0.1
    assert plans["decode"].reason == "within_thresholds"  # 0.2: under 0.4, over 0.1


def test_agg_counts_queued_prompt_tokens_as_kv_demand() -> None:
    p = policy(optimization_target="load", decode_scale_up_kv_rate=80, decode_scale_down_kv_rate=20, kv_block_size=10)
    # 50 held blocks + 300 queued prompt tokens / 10 = 80 blocks -> 0.8 >= 0.8 (inclusive for "load")
    assert p.plan(agg(0, worker(0, blocks=50, running=5, prefill=300)))["agg"].action == ACTION_SCALE_UP


def test_disagg_budget_refuses_scale_up_beyond_gpus() -> None:
    p = LoadPolicy(LoadPolicyConfig(mode="disagg", context_length=100, budget=ReplicaBudget(max_gpu_budget=2)))
    obs = Observation(now=0, pools={
        "prefill": PoolObservation("prefill", 1, (worker(0, prefill=500),)),
        "decode": PoolObservation("decode", 1, (worker(1, blocks=100, running=10, waiting=3),)),
    })
    plans = p.plan(obs)
    assert {k: (v.desired, v.reason) for k, v in plans.items()} == {
        "prefill": (1, "at_max_budget"), "decode": (1, "at_max_budget")}


def test_load_target_needs_its_thresholds() -> None:
    with pytest.raises(ConfigError, match="--decode-scale-up-kv-rate"):
        LoadPolicyConfig(optimization_target="load").validate()


def test_no_load_reports_hold() -> None:
    assert policy().plan(agg(0, ready=2))["agg"].reason == "no_load_data"
