"""Percentiles of samples, one definition for every figure the project reports.

``percentile`` (and ``percentiles``, which sorts once for several) interpolates linearly between
the two closest ranks: the ``q`` quantile of ``n`` sorted values sits at rank ``(n - 1) * q``
(Hyndman and Fan's type 7; numpy's and pandas' default, Excel's ``PERCENTILE.INC``). So p50 is the
textbook median, p0 the minimum and p100 the maximum, and a p99 of 100 samples is not simply the
largest one. ``q`` is a fraction (0.99 for p99), never a percent: one scale everywhere.

``nearest_rank`` is for a decision that must land on a value that was observed, not between two
(a count of workers): the smallest sample with at least ``q`` of the samples at or below it.

Reported figures (replay and benchmark JSON, a worker's transfer-time window) use ``percentile``;
a Prometheus histogram's quantile (``console/state/histogram.py``) is a different estimate, from
bucket counts rather than samples, and stays beside the histogram code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def _check(q: float) -> None:
    if not 0.0 <= q <= 1.0:  # also rejects NaN
        raise ValueError(f"quantile {q!r} is not a fraction in [0, 1] (p99 is 0.99)")


def percentile_of_sorted(ordered: Sequence[float], q: float, *, default: float = 0.0) -> float:
    """The ``q`` quantile (0..1) of values already in ascending order, linearly interpolated;
    ``default`` when there are none. For a caller that sorted once for other reasons."""
    _check(q)
    if not ordered:
        return default
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def percentiles(values: Iterable[float], qs: Sequence[float], *, default: float = 0.0) -> list[float]:
    """The ``qs`` quantiles (each 0..1) of ``values``, sorted once; ``default`` for each when empty."""
    ordered = sorted(values)
    return [percentile_of_sorted(ordered, q, default=default) for q in qs]


def percentile(values: Iterable[float], q: float, *, default: float = 0.0) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated; ``default`` when empty."""
    return percentiles(values, (q,), default=default)[0]


def nearest_rank(values: Iterable[int], q: float) -> int:
    """The smallest of ``values`` with at least ``q`` (0..1) of them at or below it (rank
    ``ceil(q * n)``, at least 1): always one of the values. Raises ValueError when empty."""
    _check(q)
    ordered = sorted(values)
    if not ordered:
        raise ValueError("nearest_rank of no values")
    # q * n in floating point can land a hair above a whole number (0.9 * 10 = 9.000000000000002):
    # round to 1e-9 first, so a rank that is exact on paper stays exact.
    rank = max(1, math.ceil(round(q * len(ordered), 9)))
    return ordered[min(rank, len(ordered)) - 1]
