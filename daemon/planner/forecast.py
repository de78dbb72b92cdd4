"""The arrival rate a worker launched now will meet: a growth-rate forecast over the start-up.

A worker launched now is ready ``startup_s`` later, and the one the next decision launches one
interval after that: the fleet sized now must carry the rate at ``now + startup + interval``. The
window's mean rate lags it by half a window plus that horizon, so on a ramp the fleet always
trails, and a diurnal ramp grows by a factor (it accelerates out of the trough), not by a
constant step.

``RateForecast`` fits ``rate(t) = level x exp(growth x t)`` to the arrivals of the last ``span_s``
seconds (per-interval counts; a Poisson log-linear fit by weighted least squares, each count's log
weighted by the count, whose variance is about ``1 / count``) and carries the fitted level at
``now`` over the horizon when the growth is significant (``growth > Z x its standard error``):

- a ramp is met a start-up ahead: the rise carried over one start-up (the previous agg
  projection, kept beside it) trailed diurnal seed 2's ramp out of the trough by a start-up
  (95.1 % attainment; 99.9 % with the forecast);
- Poisson noise on a flat rate is no growth: the fit's standard error covers it, so a plateau
  projects nothing (the rise beside it reads every upward wobble as a ramp: on the steady
  traces it plans 2-2.5x the forecast's surplus, ``bench/planner.py --compare-forecasts``);
- a falling rate projects nothing either (shrinking is the release window's job);
- a growth faster than ``STEP_GROWTH`` over the horizon is a burst's onset (a step, not a
  ramp): no forecast; slower growth is capped at ``GROWTH_CAP`` over the horizon (a raised
  cosine decelerates past its inflection, an exponential carried on overshoots the peak);
- the planner counts the forecast's surplus over the rise as transient (it scales up
  ahead of the ramp, the release window does not remember it): carried as evidence, the
  forecast's fleets were held for a whole release window (diurnal seed 1: 1910 worker-seconds
  instead of 1675).

Pure arithmetic on the samples it is given; no clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

Z = 2.0  # standard errors a growth must clear to be a trend, not Poisson noise
GROWTH_CAP = 1.5  # the most a forecast grows the fitted level over its horizon (the trend's cap)
# A fitted growth of more than this over the horizon is a step (a burst's onset), not a ramp: a
# fleet cannot be launched ahead of a ramp that steep anyway, and carried it projects a multiple
# of the burst. The bench's diurnal ramps fit at most ~2.4x per 35 s, burst onsets 5-20x; 3x
# and 6x here give the same bench figures.
STEP_GROWTH = 4.0
MIN_POINTS = 4  # intervals before a fit says anything


@dataclass(frozen=True, slots=True)
class Forecast:
    """One forecast: the fitted rate now, its growth, and the rate carried over the horizon."""

    level: float  # requests/s at now, as fitted (the measured mean when there is no fit)
    growth_per_s: float  # fitted d ln(rate) / dt (0 without a fit)
    growth_se: float  # its standard error (inf without a fit)
    horizon_s: float
    rate: float  # the forecast: level x exp(growth x horizon), capped; the level without a trend
    # The growth is significant and steeper than ``STEP_GROWTH`` over the horizon: a burst's
    # onset (a step), which projects nothing here and which the agg planner sizes for the level
    # measured since it (``reactive.ReactiveCore``) instead of carrying its rise.
    onset: bool = False

    @property
    def significant(self) -> bool:
        return self.growth_per_s - Z * self.growth_se > 0.0

    def as_inputs(self) -> dict[str, float]:
        se = self.growth_se if math.isfinite(self.growth_se) else -1.0
        return {"forecast_rate": round(self.rate, 4), "forecast_growth_per_s": round(self.growth_per_s, 5),
                "forecast_growth_se": round(se, 5), "forecast_horizon_s": self.horizon_s,
                "forecast_onset": float(self.onset)}


class RateForecast:
    """Keeps ``(end, seconds, arrivals)`` per interval over ``span_s`` and fits their growth."""

    def __init__(self, span_s: float, *, z: float = Z, growth_cap: float = GROWTH_CAP,
                 step_growth: float = STEP_GROWTH) -> None:
        if span_s <= 0:
            raise ValueError(f"span_s must be > 0, got {span_s}")
        self.span_s = span_s
        self.z = z
        self.growth_cap = growth_cap
        self.step_growth = step_growth
        self._samples: deque[tuple[float, float, float]] = deque()

    def add(self, end: float, seconds: float, arrivals: float) -> None:
        """One interval's arrivals (NaN or negative counts as none)."""
        if seconds <= 0:
            return
        n = arrivals if arrivals is not None and math.isfinite(arrivals) and arrivals > 0 else 0.0
        self._samples.append((end, seconds, n))
        while self._samples and self._samples[0][0] <= end - self.span_s:
            self._samples.popleft()

    def forecast(self, now: float, horizon_s: float) -> Forecast:
        pts = list(self._samples)
        seconds = sum(s for _, s, _ in pts)
        mean = sum(n for _, _, n in pts) / seconds if seconds > 0 else 0.0
        flat = Forecast(mean, 0.0, math.inf, horizon_s, mean)
        if len(pts) < MIN_POINTS or mean <= 0:
            return flat
        # x: each interval's midpoint relative to now; y: log rate (+0.5 so an empty interval
        # is finite); weight: the count (Poisson: var(log n) ~ 1 / n), at least 0.5.
        xs = [end - s / 2.0 - now for end, s, _ in pts]
        ys = [math.log((n + 0.5) / s) for _, s, n in pts]
        ws = [max(n, 0.5) for _, _, n in pts]
        sw = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
        my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
        if sxx <= 0:
            return flat
        growth = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sxx
        se = math.sqrt(1.0 / sxx)
        level = math.exp(my - growth * mx)  # the fitted line at x = 0 (now)
        grow = math.exp(min(growth * horizon_s, 50.0))
        if growth - self.z * se <= 0.0:
            return Forecast(level, growth, se, horizon_s, mean)
        if grow > self.step_growth:
            return Forecast(level, growth, se, horizon_s, mean, onset=True)
        carried = level * min(grow, self.growth_cap)
        return Forecast(level, growth, se, horizon_s, max(mean, carried))
