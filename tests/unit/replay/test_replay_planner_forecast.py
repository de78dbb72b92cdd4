"""The agg planner's rate forecast in the replay loop: a ramp out of a trough is met a start-up
ahead instead of trailed, and the workers the forecast added go once the ramp ends, without
turning the fleet around again (the forecast's surplus is transient, not release-window evidence)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dynamod.daemon.planner.forecast import RateForecast
from dynamod.daemon.replay.planner_loop import ReplayPlanner
from dynamod.daemon.replay.simulator import replay

from .helpers import requests
from .test_replay_planner_scaling import STARTUP_S, Recorder, engine, load_policy, reversals, rows, sizes

PLATEAU_AT_S = math.log(30.0) / 0.2  # 2 req/s growing x e^0.2t reaches 60 req/s here


def ramp(t: float) -> float:
    """2 req/s growing by e^(0.2 t) (x2.2 per start-up + interval) to 60 req/s, then flat."""
    return min(2.0 * math.exp(0.2 * t), 60.0)


def run(forecast: bool) -> tuple[dict[str, Any], Recorder, int]:
    policy = load_policy(max_gpu_budget=8)
    if not forecast:  # no growth is significant: the forecast never carries a rate (nor sees an onset)
        policy.core._forecast = RateForecast(policy.core._forecast.span_s, z=math.inf)
    rec = Recorder(policy)
    reqs = requests(*rows(ramp, 40.0))
    res = replay(reqs, workers=1, mode="kv", mocker=engine(num_gpu_blocks=65536), sla_targets=(2000.0, 50.0),
                 planner=ReplayPlanner(rec, startup_s=STARTUP_S))
    return res, rec, len(reqs)


@pytest.fixture(scope="module")
def with_and_without() -> tuple[tuple[dict[str, Any], Recorder, int], tuple[dict[str, Any], Recorder, int]]:
    return run(True), run(False)


def first_scale_up(rec: Recorder) -> float:
    return next(o.now for o, p in rec.log if p["agg"].desired > o.pools["agg"].ready + o.pools["agg"].starting)


def test_a_ramp_is_met_a_start_up_ahead(with_and_without: Any) -> None:
    (on, rec_on, n), (off, rec_off, _n) = with_and_without
    assert on["completed"] == off["completed"] == n
    assert first_scale_up(rec_on) < first_scale_up(rec_off)
    assert on["sla"]["attainment_pct"] > off["sla"]["attainment_pct"]
    # the decision record says what the forecast carried
    up = next(p["agg"] for o, p in rec_on.log if p["agg"].desired > o.pools["agg"].ready + o.pools["agg"].starting)
    assert up.inputs["forecast_rate"] > up.inputs["window_rate"]
    assert up.inputs["forecast_growth_per_s"] > 2 * up.inputs["forecast_growth_se"]


def test_the_forecasts_workers_go_once_the_ramp_ends_and_the_fleet_stays(with_and_without: Any) -> None:
    (on, rec_on, _n), (off, rec_off, _n2) = with_and_without
    seq = sizes(rec_on)
    assert max(seq) > seq[-1]  # the forecast ran ahead of the plateau's need ...
    assert reversals(seq) <= 1  # ... and gave the surplus back once, never to take it again
    plateau = [p["agg"].desired for o, p in rec_on.log if o.now >= PLATEAU_AT_S + 2 * STARTUP_S + 2]
    assert len(set(plateau)) == 1, plateau
    assert plateau[0] == sizes(rec_off)[-1]  # the fleet the measured rate asks for
    assert reversals(sizes(rec_off)) == 0
