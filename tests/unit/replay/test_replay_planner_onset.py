"""A burst's onset in the agg planner (issue 22, bursty seed 2): a step is sized for the level
measured since it, not for the window's rise carried over a start-up (which projects a step at up
to 2.5x its level). A step one worker carries launches nothing; a step it cannot carry is met at
the same first decision, with the fleet its level needs instead of twice that.

Bench-like timing (5 s interval, 30 s start-up: the forecast's span is a window plus a start-up)
and evenly spaced requests of 4k-token prompts; the step's level is a multiple of the rate the
capacity model says one worker carries, so the test follows the profile."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dynamod.daemon.perf.profile import PerfProfile, default_profile_path
from dynamod.daemon.planner.capacity import CapacityModel, Demand
from dynamod.daemon.planner.load_policy import LoadPolicy, LoadPolicyConfig, ReplicaBudget
from dynamod.daemon.replay.planner_loop import ReplayPlanner
from dynamod.daemon.replay.simulator import replay

from .helpers import requests
from .test_replay_planner_scaling import Recorder, engine, rows, sizes

INTERVAL_S, STARTUP_S = 5.0, 30.0
BLOCKS, OUT = 256, 50  # 4096-token prompts, 50-token outputs
BASE, STEP_AT, STEP_END, END = 0.3, 60.0, 120.0, 200.0


def one_worker_rate() -> float:
    """Requests/s the capacity model says one agg worker carries at this prompt and output size."""
    model = CapacityModel(PerfProfile.load(default_profile_path()), mode="agg", ttft_ms=2000.0, itl_ms=50.0)
    return 1.0 / model.size(Demand(1.0, BLOCKS * 16, OUT, 0.0)).prefill_load


def run(level: float, *, planner: bool = True) -> tuple[dict[str, Any], Recorder | None]:
    def rate(t: float) -> float:
        return level if STEP_AT <= t < STEP_END else BASE

    reqs = requests(*rows(rate, END, blocks=BLOCKS, out=OUT))
    rec = None
    if planner:
        rec = Recorder(LoadPolicy(LoadPolicyConfig(mode="agg", interval_s=INTERVAL_S, startup_s=STARTUP_S,
                                                   ttft_ms=2000.0, itl_ms=50.0,
                                                   budget=ReplicaBudget(max_gpu_budget=8))))
    res = replay(reqs, workers=1, mode="kv", mocker=engine(num_gpu_blocks=65536), sla_targets=(2000.0, 50.0),
                 planner=ReplayPlanner(rec, startup_s=STARTUP_S) if rec is not None else None)
    return res, rec


@pytest.fixture(scope="module")
def carried() -> tuple[dict[str, Any], Recorder, dict[str, Any]]:
    """A step to 70 % of what one worker carries, with the planner and on one static worker."""
    res, rec = run(0.7 * one_worker_rate())
    static, _ = run(0.7 * one_worker_rate(), planner=False)
    assert rec is not None
    return res, rec, static


def test_a_step_one_worker_carries_launches_nothing(carried: Any) -> None:
    res, rec, static = carried
    assert res["planner"]["scale_ups"] == 0, sizes(rec)
    assert res["worker_seconds"] == pytest.approx(static["worker_seconds"])
    assert res["sla"]["attainment_pct"] == static["sla"]["attainment_pct"] == 100.0


def test_the_decision_record_says_what_the_onset_was_sized_for(carried: Any) -> None:
    _res, rec, _static = carried
    onset = [p["agg"].inputs for o, p in rec.log if "onset_level" in p["agg"].inputs]
    assert onset, "no decision saw the burst's onset"
    at = [o.now for o, p in rec.log if "onset_level" in p["agg"].inputs]
    # from the first decision after the step, for at most a forecast span (a window and a start-up)
    assert min(at) == STEP_AT + INTERVAL_S
    assert max(at) <= STEP_END + 6 * INTERVAL_S + STARTUP_S
    # the rise carried over the start-up asked more than the step's level, and was not planned for
    assert any(i["carried_rate"] > 1.5 * i["onset_level"] for i in onset)
    assert all(i["request_rate"] <= i["onset_level"] + 1e-6 for i in onset)


def test_a_step_one_worker_cannot_carry_is_met_at_its_onset_with_the_fleet_its_level_needs() -> None:
    res, rec = run(1.5 * one_worker_rate())
    static, _ = run(1.5 * one_worker_rate(), planner=False)
    assert rec is not None
    first_up = next(o.now for o, p in rec.log if p["agg"].desired > o.pools["agg"].ready + o.pools["agg"].starting)
    assert first_up <= STEP_AT + 2 * INTERVAL_S  # the first decisions that saw the step
    # the measured level needs two workers; the rise carried over the start-up asked for four
    assert max(sizes(rec)) == math.ceil(1.5)
    assert res["sla"]["attainment_pct"] > static["sla"]["attainment_pct"]
