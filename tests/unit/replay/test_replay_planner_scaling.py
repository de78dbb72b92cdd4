"""The planner's known failure classes, replayed with the real policies, router and mocker cores on
the simulated clock (issue 22, item 3): no oscillation under constant load, the minimum when
traffic stops, a scale-up counted only once ready and never undone before it served, the GPU
budget never passed by a P/D rebalance, no request lost to a scale-down, and SLA misses naming
themselves in the decision that answers them."""

from __future__ import annotations

from typing import Any

import pytest

from dynamod.daemon.perf.profile import PerfProfile, default_profile_path
from dynamod.daemon.planner.capacity import Demand
from dynamod.daemon.planner.load_policy import LoadPolicy, LoadPolicyConfig, ReplicaBudget
from dynamod.daemon.planner.policy import Observation, PoolPlan
from dynamod.daemon.planner.predictors import PredictorConfig
from dynamod.daemon.planner.sla_policy import SlaPolicy, SlaPolicyConfig
from dynamod.daemon.replay.planner_loop import ReplayPlanner
from dynamod.daemon.replay.simulator import replay, replay_disagg

from .helpers import mocker, requests

STARTUP_S = 3.0
INTERVAL_S = 1.0


def engine(num_gpu_blocks: int = 4096) -> Any:
    """The profiled engine's step budget (the policies size from the shipped profile)."""
    return mocker(num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=8192, max_num_seqs=64)


def rows(rate_at: Any, end_s: float, blocks: int = 64, out: int = 20) -> list[tuple[float, list[int], int]]:
    """Evenly spaced requests at ``rate_at(t)`` per second, each prompt its own ``blocks`` x 16 tokens."""
    out_rows, t, i = [], 0.0, 0
    while t < end_s:
        out_rows.append((t * 1000.0, [1_000_000 + i * blocks + k for k in range(blocks)], out))
        t += 1.0 / rate_at(t)
        i += 1
    return out_rows


def load_policy(mode: str = "agg", **budget: int) -> LoadPolicy:
    return LoadPolicy(LoadPolicyConfig(mode=mode, interval_s=INTERVAL_S, startup_s=STARTUP_S, ttft_ms=2000.0,
                                       itl_ms=50.0, grace_period_s=30.0, budget=ReplicaBudget(**budget)))


def sla_policy(mode: str = "agg", **budget: int) -> SlaPolicy:
    return SlaPolicy(SlaPolicyConfig(mode=mode, interval_s=10.0, reactive_interval_s=INTERVAL_S, startup_s=STARTUP_S,
                                     ttft_ms=2000.0, itl_ms=50.0, predictor=PredictorConfig(kind="constant"),
                                     budget=ReplicaBudget(**budget)), PerfProfile.load(default_profile_path()))


class Recorder:
    """Wraps a policy: keeps every observation and plan the replay loop exchanged with it."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.name = policy.name
        self.interval_s = policy.interval_s
        self.config = policy.config
        self.log: list[tuple[Observation, dict[str, PoolPlan]]] = []

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        plans = self.policy.plan(observation)
        self.log.append((observation, plans))
        return plans


def sizes(rec: Recorder, pool: str = "agg") -> list[int]:
    return [plans[pool].desired for _, plans in rec.log]


def reversals(seq: list[int]) -> int:
    """How often the fleet turned around (up then down, or down then up)."""
    steps = [b - a for a, b in zip(seq, seq[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if (a > 0) != (b > 0))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_oscillation_under_constant_load(n: int) -> None:
    """A constant rate the capacity model sizes at ``n`` workers (n - 0.4 workers of prefill at
    the prefill share that keeps ITL), starting at ``n``: the fleet never turns around. The
    engine has the profile's KV size, so that the profile describes its decode steps."""
    policy = load_policy(max_gpu_budget=8)
    lo, hi = 0.0, 200.0  # the rate the model sizes at n - 0.4 workers of prefill (1024-token prompts, 20 out)
    for _ in range(50):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if policy.model.size(Demand(mid, 1024.0, 20.0)).prefill_load < n - 0.4 else (lo, mid)
    reqs = requests(*rows(lambda _t: lo, 60.0))
    rec = Recorder(policy)
    res = replay(reqs, workers=n, mode="kv", mocker=engine(num_gpu_blocks=65536), sla_targets=(2000.0, 50.0),
                 planner=ReplayPlanner(rec, startup_s=STARTUP_S))
    assert res["completed"] == len(reqs)
    assert reversals(sizes(rec)) == 0, sizes(rec)


@pytest.fixture(scope="module")
def burst_then_trickle() -> tuple[dict[str, Any], Recorder, int]:
    """One worker; a 15 s burst at 60 req/s from t = 5 s; then one request every 2 s for 60 s."""
    reqs = requests(*rows(lambda t: 60.0 if 5.0 <= t < 20.0 else 0.5, 80.0))
    rec = Recorder(load_policy(max_gpu_budget=6))
    res = replay(reqs, workers=1, mode="kv", mocker=engine(), planner=ReplayPlanner(rec, startup_s=STARTUP_S),
                 sla_targets=(2000.0, 50.0))
    return res, rec, len(reqs)


def test_scales_up_in_the_burst_and_to_the_minimum_when_traffic_stops(burst_then_trickle: Any) -> None:
    res, rec, _n = burst_then_trickle
    assert res["planner"]["peak_workers"]["agg"] >= 2
    assert sizes(rec)[-1] == 1  # back to the minimum once only a trickle is left
    assert res["planner"]["scale_downs"] >= 1


def test_a_worker_counts_only_once_ready_and_serves_before_any_scale_down(burst_then_trickle: Any) -> None:
    res, rec, _n = burst_then_trickle
    first_up = next(i for i, (_o, p) in enumerate(rec.log) if p["agg"].desired > _o.pools["agg"].ready)
    obs_after = rec.log[first_up + 1][0].pools["agg"]
    assert obs_after.starting >= 1  # launched: starting, not ready
    assert obs_after.ready == rec.log[first_up][0].pools["agg"].ready
    ups = [(o.now, p["agg"].desired) for o, p in rec.log if p["agg"].desired > o.pools["agg"].ready + o.pools["agg"].starting]
    downs = [o.now for o, p in rec.log if p["agg"].desired < o.pools["agg"].ready + o.pools["agg"].starting]
    assert ups and downs
    for t_down in downs:
        last_up = max(t for t, _ in ups if t < t_down)
        assert t_down >= last_up + STARTUP_S + INTERVAL_S  # started, became ready, served an interval
    # every worker that became ready took requests before it was let go
    launched = res["planner"]["launched"]["agg"]
    served = res["requests_per_worker"]
    assert all(served[w] > 0 for w in range(1, launched) if w < len(served)), served
    # cold workers (first interval) were reported as such
    assert any(w.ready_for_s is not None and w.ready_for_s < INTERVAL_S for o, _ in rec.log for w in o.pools["agg"].loads)


def test_scale_down_drains_and_loses_no_request(burst_then_trickle: Any) -> None:
    res, _rec, n = burst_then_trickle
    assert res["completed"] == n
    assert res["output_tokens_per_s"] > 0 and res["sla"]["attainment_pct"] > 0


def test_pd_rebalance_never_passes_the_gpu_budget_even_while_draining() -> None:
    """Prefill-heavy (long prompts, 2 tokens out) then decode-heavy (short prompts, long outputs),
    budget 3: the pools trade GPUs, and the held GPUs (starting + ready + draining) never pass 3."""
    heavy_prefill = rows(lambda _t: 40.0, 15.0, blocks=256, out=2)
    heavy_decode = [(t + 15_000.0, [2_000_000 + i * 4 + k for k in range(4)], 300)
                    for i, (t, _ids, _o) in enumerate(rows(lambda _t: 40.0, 20.0, blocks=4))]
    reqs = requests(*heavy_prefill, *heavy_decode)
    rec = Recorder(load_policy("disagg", max_gpu_budget=3))
    res = replay_disagg(reqs, prefill_workers=1, decode_workers=1, mode="kv", mocker=engine(),
                        planner=ReplayPlanner(rec, startup_s=STARTUP_S), sla_targets=(2000.0, 50.0))
    assert res["completed"] == len(reqs)
    assert res["planner"]["max_gpus_held"] <= 3
    held = [sum(p.ready + p.starting + p.draining for p in o.pools.values()) for o, _ in rec.log]
    assert max(held) <= 3
    assert res["planner"]["scale_ups"] >= 1
    assert "at_max_budget" in res["planner"]["reasons"] or max(held) < 3


def test_sla_planner_names_the_miss_it_answers() -> None:
    """One worker under prompts it cannot prefill in time: the SLA planner's decision says why."""
    reqs = requests(*rows(lambda _t: 50.0, 20.0, blocks=128))
    rec = Recorder(sla_policy(max_gpu_budget=4))
    res = replay(reqs, workers=1, mode="kv", mocker=engine(), planner=ReplayPlanner(rec, startup_s=STARTUP_S),
                 sla_targets=(2000.0, 50.0))
    assert res["completed"] == len(reqs)
    ups = [p["agg"] for o, p in rec.log if p["agg"].desired > o.pools["agg"].ready + o.pools["agg"].starting]
    assert ups
    reasons = {p.reason for p in ups}
    assert reasons & {"ttft_miss", "queue_backlog", "itl_miss_prefill_interference", "capacity", "sla_throughput",
                      "at_max_budget"}
    first = ups[0]
    assert first.inputs["request_rate"] > 0 and "prefill_thpt" in first.inputs and first.detail
