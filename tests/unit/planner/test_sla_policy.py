"""The SLA planner's formulas against numbers worked out by hand on a two-point profile."""

from __future__ import annotations

import math

import pytest

from dynamod.daemon.perf.profile import DecodeRow, DecodeTable, PerfProfile, PrefillTable
from dynamod.daemon.planner.capacity import MISS_AIM
from dynamod.daemon.planner.load_policy import ReplicaBudget
from dynamod.daemon.planner.policy import (
    Observation,
    PoolObservation,
    TrafficSample,
    binomial_request_miss,
    exponential_osl_classes,
)
from dynamod.daemon.planner.predictors import PredictorConfig
from dynamod.daemon.planner.sla_policy import SlaPolicy, SlaPolicyConfig
from dynamod.shared.protocol.planner import ACTION_HOLD, ACTION_SCALE_UP


def profile() -> PerfProfile:
    """Prefill: 10,000 tok/s/GPU at any ISL, TTFT 100 ms per 1,000 tokens. Decode (both context
    rows alike): ITL 10/30/60 ms and 1,000/3,000/4,000 tok/s/GPU at KV usage 0.1/0.5/0.9."""
    row = dict(kv_usage=[0.1, 0.5, 0.9], itl_ms=[10.0, 30.0, 60.0], thpt_per_gpu=[1000.0, 3000.0, 4000.0])
    return PerfProfile(
        PrefillTable([1000.0, 3000.0], [100.0, 300.0], [10000.0, 10000.0]),
        DecodeTable([DecodeRow(1000.0, **row), DecodeRow(5000.0, **row)], max_kv_tokens=100_000),  # type: ignore[arg-type]
    ).validate()


def sla(mode: str = "disagg", **kw: object) -> SlaPolicy:
    cfg: dict[str, object] = dict(mode=mode, interval_s=30.0, predictor=PredictorConfig(kind="constant"))
    cfg.update(kw)
    return SlaPolicy(SlaPolicyConfig(**cfg), profile())  # type: ignore[arg-type]


def test_prefill_replicas_and_correction_only_below_one() -> None:
    p = sla()
    # 10 req/s x 3000 tok = 30,000 tok/s / 10,000 = 3
    assert p.size(10, 3000, 200, 1.0, 1.0).prefill_replicas == 3
    assert p.size(10, 3000, 200, 0.5, 1.0).prefill_replicas == 2  # 15,000 / 10,000 = 1.5 -> 2
    assert p.size(10, 3000, 200, 2.0, 1.0).prefill_replicas == 3  # a factor over 1 is queueing: ignored


def test_decode_replicas_from_best_throughput_under_itl() -> None:
    p = sla()
    s = p.size(20, 3000, 200, 1.0, 1.0)
    # ITL 50 ms is reached at KV usage 0.5 + 0.4 * 20/30 = 0.767; the 200-step scan stops at 0.764:
    # throughput 3000 + 1000 * 0.264 / 0.4 = 3660 tok/s/GPU; 20 x 200 = 4000 tok/s -> 2 replicas
    assert s.decode_thpt_per_gpu == pytest.approx(3660, abs=1)
    assert s.decode_replicas == 2
    # d_correction 2: the engines run twice as slow as profiled -> aim at ITL 25 ms: usage 0.4,
    # 2500 tok/s/GPU: 30 x 200 = 6000 -> 3 replicas (2 without the correction)
    assert p.size(30, 3000, 200, 1.0, 1.0).decode_replicas == 2
    assert p.size(30, 3000, 200, 1.0, 2.0).decode_thpt_per_gpu == pytest.approx(2500, abs=15)
    assert p.size(30, 3000, 200, 1.0, 2.0).decode_replicas == 3


def test_correction_factors_from_a_traffic_sample() -> None:
    p = sla()
    sample = TrafficSample(duration_s=30, num_requests=300, isl=3000, osl=200, ttft_ms=600, itl_ms=20)
    pc, dc = p.correction_factors(sample, decode_replicas=2)
    assert pc == pytest.approx(2.0)  # 600 / profile TTFT 300
    # duration 0.6 + 0.02 x 199 = 4.58 s; 10 req/s x 4.58 / 2 replicas = 22.9 in flight per engine;
    # x 3100 tokens / 100,000 = KV usage 0.7099 -> profile ITL 30 + 30 x 0.2099 / 0.4 = 45.74 ms
    assert dc == pytest.approx(20 / 45.7425, rel=1e-3)


def test_gpu_budget_scales_both_pools_dynamo_style() -> None:
    p = sla(budget=ReplicaBudget(max_gpu_budget=4))
    obs = Observation(now=30, pools={"prefill": PoolObservation("prefill", 1), "decode": PoolObservation("decode", 1)},
                      traffic=TrafficSample(duration_s=30, num_requests=300, isl=3000, osl=600, ttft_ms=None, itl_ms=None))
    plans = p.plan(obs)
    # Prefill: 30,000 tok/s / 10,000 at the utilisation whose M/D/1 wait fits TTFT 500 ms with a
    # 300 ms prompt (2 x 200 / (300 + 2 x 200) = 0.571) -> 5.25 -> 6 (ceil(share) said 3);
    # decode 10 x 600 / 3660 -> 2. 6 is over the 4 GPUs alone -> 4; 4 + 2 > 4: scale 4/6,
    # prefill floor(2.67) = 2, decode 4 - 2 = 2.
    assert plans["prefill"].inputs["predicted_floor"] == 6 and plans["prefill"].inputs["dynamo_replicas"] == 3
    assert plans["decode"].inputs["predicted_floor"] == 2
    assert (plans["prefill"].desired, plans["decode"].desired) == (2, 2)
    assert plans["prefill"].reason == "at_max_budget"
    assert plans["prefill"].action == ACTION_SCALE_UP
    assert plans["decode"].predicted == {"request_rate": 10.0, "isl": 3000.0, "osl": 600.0}


def test_agg_sizes_one_pool_by_the_prefill_share_itl_allows() -> None:
    p = sla("agg", budget=ReplicaBudget(max_gpu_budget=32))
    # Dynamo's time sharing: 30,000 / 10,000 + 2,000 / 3,660 = 3.55 -> 4 (every engine 100% busy)
    assert p.size(10, 3000, 200, 1.0, 1.0).decode_replicas == 4
    # Was the plan. But a step carrying a prompt's prefill (300 ms here) among 10 ms decode steps
    # is a long gap: at a prefill time share f a step carries one with probability
    # p = f x 10 / (c (1 - f)), c the step's prefill (the prompt and the M/D/1 queue beside it),
    # and a request misses its mean ITL L when more than (L - 10) / c of its gaps do. The share
    # is the largest f whose expected misses (output lengths exponential around 200) stay within
    # the model's part of the error budget (2/3 of 2 %), and at most the M/D/1 utilisation that
    # keeps TTFT. (Taking f itself as the chance of a 300 ms gap said 0.138 at 50 ms.)
    def misses(f: float, itl: float) -> float:
        busy = f * (1 + 10 / 300)
        c = p.model.profile.prefill.ttft(min(3000 * (1 + busy * busy / (2 * (1 - busy))), 8192))
        return binomial_request_miss(exponential_osl_classes(200), f * 10 / (c * (1 - f)), (itl - 10) / c)

    aim = MISS_AIM * 0.02
    share = p.model.agg_prefill_share(3000, 200)
    assert misses(share, 50.0) <= aim
    assert share == pytest.approx(p.model.ttft_utilisation(3000))  # at 50 ms the TTFT queue binds first: 0.571
    tight = sla("agg", itl_ms=30.0).model.agg_prefill_share(3000, 200)
    assert misses(tight, 30.0) <= aim < misses(tight + 0.01, 30.0)  # at 30 ms the ITL binds
    assert 0.1 < tight < share
    obs = Observation(now=30, pools={"agg": PoolObservation("agg", 1)},
                      traffic=TrafficSample(duration_s=30, num_requests=300, isl=3000, osl=200, ttft_ms=None, itl_ms=None))
    plan = p.plan(obs)["agg"]
    # Sized, the requests decoding beside the prefills (10 req/s x 200 tokens at the ITL they
    # see, Little's law) lengthen the decode steps on this profile: the share is lower than the
    # bare one, and the floor is 3 workers' prefill over it.
    cap = plan.inputs["prefill_cap"]
    assert 0.1 < cap < share
    assert plan.inputs["predicted_floor"] == math.ceil(3.0 / cap - 1e-9) and plan.inputs["dynamo_replicas"] == 4
    # from 1 worker, the 30 s start-up's arrivals are a queue to clear as well: more than the floor
    assert plan.desired == 9 and plan.reason in ("queue_backlog", "max_scaling_step")


def test_no_traffic_holds_and_step_cap_applies() -> None:
    p = sla(max_scaling_step=1)
    empty = Observation(now=30, pools={"prefill": PoolObservation("prefill", 1), "decode": PoolObservation("decode", 1)},
                        traffic=TrafficSample(duration_s=30, num_requests=0, isl=None, osl=None, ttft_ms=None, itl_ms=None))
    assert {v.reason for v in p.plan(empty).values()} == {"no_traffic"}
    assert {v.action for v in p.plan(empty).values()} == {ACTION_HOLD}
    busy = Observation(now=60, pools=empty.pools,
                       traffic=TrafficSample(duration_s=30, num_requests=900, isl=3000, osl=200, ttft_ms=None, itl_ms=None))
    plans = p.plan(busy)  # raw prefill 9, capped at one step
    assert (plans["prefill"].desired, plans["prefill"].reason) == (2, "max_scaling_step")


def test_the_predictive_floor_holds_the_pool_but_is_no_release_evidence() -> None:
    """The first slow interval predicts from the first 5 s (here a burst of 6k-token prompts): a
    floor of the whole budget. It holds the pool while it stands; once the next prediction drops
    it, the pool shrinks to what the measured traffic needed, instead of holding the guess for a
    whole release window (10 start-ups: 50 s here)."""
    p = SlaPolicy(SlaPolicyConfig(mode="agg", interval_s=30.0, reactive_interval_s=5.0, startup_s=5.0, ttft_ms=2000.0,
                                  itl_ms=50.0, predictor=PredictorConfig(kind="constant"),
                                  budget=ReplicaBudget(max_gpu_budget=8)), profile())
    ready, seen = 1, []
    for i in range(1, 16):
        first = i == 1
        traffic = TrafficSample(duration_s=5.0, num_requests=20.0 if first else 5.0, isl=6000.0 if first else 500.0,
                                osl=50.0, ttft_ms=300.0, itl_ms=10.0)
        plan = p.plan(Observation(now=5.0 * i, pools={"agg": PoolObservation("agg", ready)}, traffic=traffic))["agg"]
        seen.append((5.0 * i, plan.desired, plan.inputs.get("predicted_floor")))
        ready = plan.desired  # workers ready at once: only the guard's memory is under test
    assert seen[0][1] == 8 and seen[0][2] is not None and seen[0][2] >= 8  # the guess: the whole budget
    dropped = next(t for t, _d, floor in seen if floor is not None and floor < 8)
    assert all(d == 8 for t, d, _f in seen if t < dropped)  # held while it stood
    assert next(d for t, d, _f in seen if t == dropped) < 8  # released at once when it fell ...
    assert seen[-1][1] == 1  # ... to what one worker serves, within 40 s of the drop (the window is 50 s)
