"""The arrival-rate forecast (``forecast.RateForecast``): a ramp is carried over the horizon,
Poisson noise, a fall and a burst's onset are not."""

from __future__ import annotations

import math
import random

import pytest

from dynamod.daemon.planner.forecast import GROWTH_CAP, RateForecast

DT = 5.0
SPAN = 60.0
HORIZON = 35.0


def fed(counts: list[float]) -> RateForecast:
    fc = RateForecast(SPAN)
    for i, n in enumerate(counts):
        fc.add((i + 1) * DT, DT, n)
    return fc


def test_an_exponential_ramp_is_carried_over_the_horizon() -> None:
    growth = 0.015  # per second: x1.69 over 35 s, a diurnal ramp out of its trough
    counts = [2.0 * DT * math.exp(growth * (i + 0.5) * DT) for i in range(12)]
    fc = fed(counts).forecast(12 * DT, HORIZON)
    assert fc.significant
    assert fc.growth_per_s == pytest.approx(growth, rel=0.1)
    now_rate = 2.0 * math.exp(growth * 12 * DT)
    assert fc.rate == pytest.approx(now_rate * math.exp(growth * HORIZON), rel=0.1)
    assert fc.rate > sum(counts) / (len(counts) * DT) * 1.5  # well ahead of the window's mean


def test_a_fast_ramp_is_capped() -> None:
    growth = 0.035  # x3.4 over the horizon: under the step threshold, over the cap
    counts = [2.0 * DT * math.exp(growth * (i + 0.5) * DT) for i in range(12)]
    fc = fed(counts).forecast(12 * DT, HORIZON)
    assert fc.significant
    assert fc.rate == pytest.approx(fc.level * GROWTH_CAP, rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_poisson_noise_on_a_flat_rate_is_no_trend(seed: int) -> None:
    rng = random.Random(seed)
    counts = []
    for _ in range(12):  # Poisson(20) per interval: 4 req/s
        n, t = 0, rng.expovariate(4.0)
        while t < DT:
            n, t = n + 1, t + rng.expovariate(4.0)
        counts.append(float(n))
    fc = fed(counts).forecast(12 * DT, HORIZON)
    assert not fc.significant
    assert fc.rate == pytest.approx(sum(counts) / (12 * DT))


def test_a_falling_rate_forecasts_the_measured_mean() -> None:
    counts = [40.0 - 3.0 * i for i in range(12)]
    fc = fed(counts).forecast(12 * DT, HORIZON)
    assert fc.growth_per_s < 0
    assert fc.rate == pytest.approx(sum(counts) / (12 * DT))


def test_a_bursts_onset_is_a_step_not_a_ramp() -> None:
    """A quiet base, then 20x it for the last 20 s: the fit's growth is far past the step
    threshold, and the forecast stays the measured mean instead of a multiple of the burst."""
    counts = [1.0] * 8 + [20.0] * 4
    fc = fed(counts).forecast(12 * DT, HORIZON)
    assert math.exp(fc.growth_per_s * HORIZON) > 4.0
    assert fc.rate == pytest.approx(sum(counts) / (12 * DT))


def test_too_few_points_or_no_traffic_forecast_the_mean() -> None:
    assert fed([10.0, 20.0, 40.0]).forecast(15.0, HORIZON).rate == pytest.approx(70.0 / 15.0)
    assert fed([0.0] * 12).forecast(60.0, HORIZON).rate == 0.0
    old = fed([5.0] * 30)  # only the last span is kept
    assert old.forecast(150.0, HORIZON).rate == pytest.approx(1.0)
    with pytest.raises(ValueError):
        RateForecast(0.0)
