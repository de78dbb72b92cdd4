"""The shared reactive core, the capacity model and the start-up hysteresis, on hand-made
observations: every SLA miss drives an action that names it, idle pools go to the minimum,
cold workers are no evidence, and the GPU budget counts starting and draining workers."""

from __future__ import annotations

import math

import pytest

from dynamod.daemon.perf.profile import PerfProfile, default_profile_path
from dynamod.daemon.planner.budget import ReplicaBudget
from dynamod.daemon.planner.capacity import CapacityModel, Demand
from dynamod.daemon.planner.hysteresis import ScaleGuard
from dynamod.daemon.planner.load_policy import LoadPolicy, LoadPolicyConfig
from dynamod.daemon.planner.policy import (
    Observation,
    PoolObservation,
    TrafficSample,
    WorkerLoad,
    fraction_over,
)
from dynamod.daemon.planner.predictors import PredictorConfig
from dynamod.daemon.planner.reactive import Need
from dynamod.daemon.planner.scaling import PoolSizer
from dynamod.daemon.planner.sla_policy import SlaPolicy, SlaPolicyConfig
from dynamod.shared.protocol.planner import ACTION_HOLD, ACTION_SCALE_DOWN, ACTION_SCALE_UP


def w(wid: int, *, blocks: int = 0, running: int = 0, waiting: int = 0, prefill: int = 0, age: float | None = None,
      total: int = 1000) -> WorkerLoad:
    return WorkerLoad(worker_id=wid, kv_usage=blocks / total, num_waiting=waiting, num_running=running,
                      active_prefill_tokens=prefill, active_decode_blocks=blocks, total_blocks=total, ready_for_s=age)


def traffic(rate: float = 1.0, *, isl: float | None = 2000.0, osl: float | None = 100.0, ttft_over: float = 0.0,
            itl_over: float = 0.0, n: int = 100, duration: float = 5.0) -> TrafficSample:
    """``n`` requests' TTFTs and gaps, ``ttft_over``/``itl_over`` of them far over any target."""
    t_miss, i_miss = round(n * ttft_over), round(n * itl_over)
    return TrafficSample(
        duration_s=duration, num_requests=rate * duration, isl=isl, osl=osl, ttft_ms=100.0, itl_ms=10.0,
        ttft_buckets=((100.0, float(n - t_miss)), (10_000.0, float(n - t_miss)), (math.inf, float(n))),
        itl_buckets=((20.0, float(n - i_miss)), (1_000.0, float(n - i_miss)), (math.inf, float(n))))


def agg_obs(now: float, *loads: WorkerLoad, sample: TrafficSample | None = None, starting: int = 0) -> Observation:
    return Observation(now=now, pools={"agg": PoolObservation("agg", len(loads), loads, starting=starting)},
                       traffic=sample)


def load_policy(mode: str = "agg", **kw: object) -> LoadPolicy:
    cfg: dict[str, object] = dict(mode=mode, interval_s=5.0, startup_s=10.0, ttft_ms=2000.0, itl_ms=50.0)
    cfg.update(kw)
    return LoadPolicy(LoadPolicyConfig(**cfg))  # type: ignore[arg-type]


def sla_policy(mode: str = "agg", **kw: object) -> SlaPolicy:
    cfg: dict[str, object] = dict(mode=mode, interval_s=60.0, reactive_interval_s=5.0, startup_s=10.0,
                                  ttft_ms=2000.0, itl_ms=50.0, predictor=PredictorConfig(kind="constant"))
    cfg.update(kw)
    return SlaPolicy(SlaPolicyConfig(**cfg), PerfProfile.load(default_profile_path()))  # type: ignore[arg-type]


def rate_for_load(model: CapacityModel, load: float, isl: float, osl: float) -> float:
    """The request rate the capacity model sizes at ``load`` workers of prefill (its agg prefill
    share depends on the rate: the requests decoding beside the prefills lengthen the steps)."""
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if model.size(Demand(mid, isl, osl)).prefill_load < load else (lo, mid)
    return lo


def test_fraction_over_counts_only_buckets_wholly_over_unless_asked_to_interpolate() -> None:
    buckets = ((1000.0, 50.0), (2500.0, 80.0), (math.inf, 100.0))
    assert fraction_over(buckets, 1000.0) == pytest.approx(0.5)
    assert fraction_over(buckets, 2000.0) == pytest.approx(0.2)  # the 1-2.5 s bucket may all be within 2 s
    assert fraction_over(buckets, 2000.0, interpolate=True) == pytest.approx(0.3)  # 50 + 30 x 1000/1500 under
    assert fraction_over(buckets, 5000.0) == pytest.approx(0.0)  # the +Inf bucket may all be under 5 s
    assert fraction_over((), 1.0) is None


@pytest.mark.parametrize("make", [load_policy, sla_policy])
def test_a_ttft_miss_scales_up_with_a_reason_naming_it(make) -> None:
    p = make()
    plan = p.plan(agg_obs(5, w(0, blocks=10, running=1, age=100), sample=traffic(0.5, ttft_over=0.2)))["agg"]
    assert (plan.desired, plan.action, plan.reason) == (2, ACTION_SCALE_UP, "ttft_miss")
    assert "TTFT over 2000 ms for 20.0% of requests" in plan.detail
    # while that worker starts, the old fleet's misses do not add another
    plan = p.plan(agg_obs(10, w(0, blocks=10, running=1, age=105), sample=traffic(0.5, ttft_over=0.2), starting=1))["agg"]
    assert (plan.desired, plan.action) == (2, ACTION_HOLD)


def test_agg_itl_miss_names_prefill_interference_and_disagg_scales_decode() -> None:
    plan = load_policy().plan(agg_obs(5, w(0, blocks=10, running=1, age=100), sample=traffic(0.5, itl_over=0.05)))["agg"]
    assert (plan.desired, plan.reason) == (2, "itl_miss_prefill_interference")
    assert "prefill chunks share steps with decodes" in plan.detail and "disaggregated" in plan.detail
    p = load_policy("disagg")
    obs = Observation(now=5, pools={"prefill": PoolObservation("prefill", 1, (w(0, age=100),)),
                                    "decode": PoolObservation("decode", 1, (w(1, blocks=10, running=1, age=100),))},
                      traffic=traffic(0.5, itl_over=0.05, ttft_over=0.1))
    plans = p.plan(obs)
    assert (plans["decode"].desired, plans["decode"].reason) == (2, "itl_miss")
    assert (plans["prefill"].desired, plans["prefill"].reason) == (2, "ttft_miss")


def test_a_backlog_is_sized_whole_not_one_worker_per_interval() -> None:
    # 400k queued prompt tokens and 30 req/s x 2k = 60k tok/s arriving on one worker computing
    # ~41k: when a worker launched now is ready (start-up 10 s) ~590k are queued; clearing them
    # within the start-up takes ~59k tok/s more: a jump from 1, not +1.
    p = load_policy()
    plan = p.plan(agg_obs(5, w(0, running=8, waiting=190, prefill=400_000, age=100), sample=traffic(30.0)))["agg"]
    assert plan.reason == "queue_backlog" and plan.action == ACTION_SCALE_UP
    assert plan.desired >= 4
    assert plan.inputs["backlog_tokens"] == 400_000 and plan.inputs["num_waiting"] == 190
    assert plan.inputs["projected_backlog_tokens"] > 400_000
    # the same queue on a worker that outruns it before a new one could start: no scale-up for it
    calm = load_policy().plan(agg_obs(5, w(0, running=8, waiting=190, prefill=400_000, age=100),
                                      sample=traffic(0.5)))["agg"]
    assert calm.reason != "queue_backlog" and calm.inputs["projected_backlog_tokens"] == 0


@pytest.mark.parametrize("make", [load_policy, sla_policy])
def test_idle_pool_goes_to_the_minimum_after_the_window_even_with_nan_figures(make) -> None:
    p = make()
    loads = (w(0, age=100), w(1, age=100), w(2, age=100))
    busy = traffic(1.0)
    p.plan(agg_obs(0, *loads, sample=busy))
    nothing = TrafficSample(duration_s=5.0, num_requests=0, isl=math.nan, osl=None, ttft_ms=math.nan, itl_ms=None)
    plans = [p.plan(agg_obs(t, *loads, sample=nothing))["agg"] for t in range(5, 95, 5)]
    assert all(pl.action == ACTION_HOLD for pl in plans[:2])  # evidence first (a just-started planner: 20 s)
    downs = [pl for pl in plans if pl.action == ACTION_SCALE_DOWN]
    assert downs and downs[0].desired == 1  # straight to the minimum, not one by one


def test_cold_workers_are_no_evidence_the_pool_may_shrink() -> None:
    p = load_policy(scale_down_window_s=0.0)
    # the warm worker is quiet; the new one (ready 2 s, one interval is 5 s) has taken nothing yet
    loads = (w(0, blocks=10, running=1, age=100), w(1, age=2.0))
    plan = p.plan(agg_obs(100, *loads, sample=traffic(0.1)))["agg"]
    assert (plan.desired, plan.reason) == (2, "cold_start")
    warm = (w(0, blocks=10, running=1, age=105), w(1, age=7.0))
    assert p.plan(agg_obs(105, *warm, sample=traffic(0.1)))["agg"].action == ACTION_SCALE_DOWN


def test_cold_intervals_do_not_move_the_sla_correction_factors() -> None:
    p = sla_policy(interval_s=5.0)
    sample = TrafficSample(duration_s=5.0, num_requests=10, isl=2000, osl=100, ttft_ms=400.0, itl_ms=30.0)
    p.plan(agg_obs(5, w(0, blocks=10, running=1, age=100), w(1, age=1.0), sample=sample))
    assert (p.p_correction, p.d_correction) == (1.0, 1.0)
    p.plan(agg_obs(10, w(0, blocks=10, running=1, age=105), w(1, age=6.0), sample=sample))
    assert p.p_correction != 1.0 and p.d_correction != 1.0


def test_scale_down_waits_for_new_workers_to_serve_an_interval() -> None:
    g = ScaleGuard(window_s=0.0, interval_s=5.0)
    assert g.decide("agg", now=0, ready=1, committed=1, need=3).desired == 3
    held = g.decide("agg", now=5, ready=1, committed=3, need=1)
    assert (held.desired, held.reason) == (3, "scale_up_in_progress")  # never undone while starting
    held = g.decide("agg", now=30, ready=3, committed=3, need=1)
    assert (held.desired, held.reason) == (3, "scale_up_settling")  # ready now: serve an interval first
    assert g.decide("agg", now=35, ready=3, committed=3, need=1).desired == 1


def test_a_hold_only_need_holds_the_fleet_but_never_grows_it() -> None:
    """A burst onset's carried rate (``Need.hold_only``): the release window remembers it like a
    sustained need, so the fleet the burst's measured level grew is held, but it launches nothing."""
    def drive(hold: bool) -> list[int]:
        sizer = PoolSizer(ReplicaBudget(), interval_s=5.0, window_s=60.0, grace_s=0.0)
        out, ready = [], 1
        for i in range(30):
            now = 5.0 * i
            obs = agg_obs(now, *(w(k, age=100.0) for k in range(ready)))
            committed, pending = sizer.committed("agg", obs.pools["agg"], now)
            needs = [Need("agg", 2 if i == 0 else 1, "capacity", "measured level")]
            if hold and i < 6:
                needs.append(Need("agg", 3, "capacity", "carried rate", hold_only=True))
            ready = sizer.plan(obs, {"agg": needs}, {"agg": committed}, {"agg": pending})["agg"].desired
            out.append(ready)  # the workers are ready by the next decision
        return out

    held, plain = drive(True), drive(False)
    assert max(held) == max(plain) == 2  # the carried 3 launched nothing
    # without it the one interval that needed 2 is outvoted once the window has evidence; with
    # it the fleet is held until the carried needs (the last at t = 25 s) age out of the window
    assert plain.index(1) < held.index(1)
    assert held.index(1) * 5.0 > 25.0 + 60.0 / 2
    assert set(held[:held.index(1)]) == {2} and set(held[held.index(1):]) == {1}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_oscillation_under_constant_load(n: int) -> None:
    """A constant load the capacity model sizes at ``n`` workers: the pool never moves back and
    forth. The need counts the whole pool's load (survivors carrying n / (n - 1) is built in);
    the first window holds; a pool missing nothing may later probe one fewer, once."""
    p = load_policy()
    rate = rate_for_load(p.model, n - 0.5, 2000.0, 100.0)  # n - 0.5 workers' worth of prefill
    sizes, size = [], n
    for t in range(5, 900, 5):
        loads = tuple(w(i, blocks=50, running=5, age=100) for i in range(size))
        size = p.plan(agg_obs(t, *loads, sample=traffic(rate)))["agg"].desired
        sizes.append(size)
    assert set(sizes[:4]) == {n}  # evidence first (a just-started planner: a third of 6 x 10 s start-up)
    assert sizes == sorted(sizes, reverse=True)  # never back up


def test_no_probing_under_the_model_between_bursts() -> None:
    """A fleet the model sized that misses nothing is no evidence a smaller one would do: the
    learned factor never goes under 1, so a load the model sizes at 2 stays at 2 (probing one
    fewer left one worker to meet the next burst's first start-up alone)."""
    p = load_policy(scale_down_window_s=20.0, itl_ms=15.0)
    rate = rate_for_load(p.model, 1.2, 2000.0, 100.0)
    sizes, n, t = [], 2, 0
    while t < 600:
        t += 5
        loads = tuple(w(i, blocks=50, running=5, age=100) for i in range(n))
        n = p.plan(agg_obs(t, *loads, sample=traffic(rate)))["agg"].desired
        sizes.append(n)
    assert set(sizes) == {2} and p.core.learned.get("agg", 1.0) >= 1.0


def test_a_fast_burn_alone_scales_up_at_once() -> None:
    """Multiwindow, multi-burn-rate: the fast window burning at slow window / (fast window +
    start-up) times the budget adds a worker while the slow window is still within the budget
    (waiting for it would spend it); a burn under that threshold waits for the slow window."""
    p = load_policy(scale_down_window_s=300.0)
    assert p.core.fast_burn_factor == pytest.approx(300.0 / (30.0 + 10.0))
    loads = (w(0, blocks=10, running=1, age=100), w(1, blocks=10, running=1, age=100))
    rate = rate_for_load(p.model, 1.5, 2000.0, 100.0)  # the model sizes it at 2
    t = 0
    for _ in range(60):  # five calm minutes fill the slow window
        t += 5
        assert p.plan(agg_obs(t, *loads, sample=traffic(rate)))["agg"].desired == 2
    t += 5
    mild = p.plan(agg_obs(t, *loads, sample=traffic(rate, itl_over=0.15)))["agg"]  # 15 of 600 in the fast window
    assert 0.02 < mild.inputs["itl_over_frac"] < mild.inputs["fast_burn_threshold"] and mild.action == ACTION_HOLD
    t += 5
    burn = p.plan(agg_obs(t, *loads, sample=traffic(rate, itl_over=1.0)))["agg"]
    assert burn.inputs["slow_itl_over_frac"] < burn.inputs["error_budget"] == 0.02
    assert burn.inputs["itl_over_frac"] > burn.inputs["fast_burn_threshold"]
    assert (burn.desired, burn.action, burn.reason) == (3, ACTION_SCALE_UP, "itl_miss_prefill_interference")


def test_rebalance_never_passes_the_gpu_budget_counting_draining_workers() -> None:
    p = load_policy("disagg", budget=ReplicaBudget(max_gpu_budget=4))
    # 2 prefill ready + 1 draining + 1 decode = 4 GPUs held: decode's ITL miss must wait for the drain
    obs = Observation(now=50, pools={
        "prefill": PoolObservation("prefill", 2, (w(0, age=100), w(1, age=100)), draining=1),
        "decode": PoolObservation("decode", 1, (w(2, blocks=10, running=1, age=100),))},
        traffic=traffic(0.5, itl_over=0.2))
    plans = p.plan(obs)
    assert plans["decode"].desired == 1 and plans["decode"].reason == "at_max_budget"
    assert "1 draining" in plans["decode"].detail or "GPUs free" in plans["decode"].detail
    after = Observation(now=55, pools={
        "prefill": PoolObservation("prefill", 2, (w(0, age=105), w(1, age=105))),
        "decode": PoolObservation("decode", 1, (w(2, blocks=10, running=1, age=105),))},
        traffic=traffic(0.5, itl_over=0.2))
    assert p.plan(after)["decode"].desired == 2  # the drain ended: room for one


def test_decision_record_carries_predicted_load_capacity_model_and_action() -> None:
    p = sla_policy()
    plan = p.plan(agg_obs(5, w(0, blocks=10, running=1, age=100), sample=traffic(8.0)))["agg"]
    assert plan.predicted["request_rate"] == pytest.approx(8.0)
    for key in ("prefill_thpt", "decode_thpt", "prefill_cap", "predicted_floor", "dynamo_replicas", "need",
                "window_need", "request_rate", "isl", "hit_rate"):
        assert key in plan.inputs, key
    assert plan.desired == plan.inputs["need"] == plan.inputs["predicted_floor"]


def test_misses_add_a_worker_only_when_both_windows_burn_the_error_budget() -> None:
    """The SLO is an error budget (``--sla-attainment`` 98: 2 % may miss). One bad interval
    makes the fast window (30 s here) burn over the budget, under the fast-burn threshold,
    while the slow one (the 100 s scale-down window) is still within it: budget spent, no
    worker. Misses that go on burn the slow window too: then a worker, with the reason and both
    windows' shares in the record."""
    p = load_policy()
    assert p.core.slow_window_s == 100.0 and p.core.demand_window_s == 30.0
    loads = (w(0, blocks=10, running=1, age=100), w(1, blocks=10, running=1, age=100))
    rate = rate_for_load(p.model, 1.5, 2000.0, 100.0)  # the model sizes it at 2
    t = 0
    for _ in range(20):  # calm minutes fill both windows
        t += 5
        assert p.plan(agg_obs(t, *loads, sample=traffic(rate)))["agg"].desired == 2
    t += 5
    spike = p.plan(agg_obs(t, *loads, sample=traffic(rate, itl_over=0.2)))["agg"]  # 20 of 100 in one interval
    assert spike.inputs["itl_over_frac"] > 0.02 and spike.inputs["slow_itl_over_frac"] < 0.02
    assert (spike.desired, spike.action) == (2, ACTION_HOLD)
    plans = []
    for _ in range(6):  # the misses go on: the slow window passes the budget as well
        t += 5
        plans.append(p.plan(agg_obs(t, *loads, sample=traffic(rate, itl_over=0.2)))["agg"])
    up = next(pl for pl in plans if pl.action == ACTION_SCALE_UP)
    assert up.desired == 3 and up.reason == "itl_miss_prefill_interference"
    assert up.inputs["slow_itl_over_frac"] >= up.inputs["error_budget"] == 0.02
    assert "budget 2.0%" in up.detail
