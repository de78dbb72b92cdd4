"""Quantiles from Prometheus histogram buckets, the way ``histogram_quantile`` computes them.

Frontends export TTFT and ITL as cumulative histograms; the console shows p50/p99 over a recent
window by subtracting an older scrape's buckets from the newest one, then interpolating linearly
inside the bucket that holds the wanted rank (Prometheus semantics, so numbers match Grafana).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Buckets = Mapping[float, float]
"""Upper bound (``le``) -> cumulative count; ``math.inf`` is the +Inf bucket."""


def quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q``-quantile (0..1) of a cumulative histogram; None when it holds no observations.

    Like Prometheus: a rank in the +Inf bucket returns the highest finite bound, a rank in the
    first bucket interpolates from 0.
    """
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0 or math.isnan(total):
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return bounds[-1] if not math.isinf(bounds[-1]) else None


def subtract(newer: Buckets, older: Buckets) -> dict[float, float]:
    """Observations made between two scrapes of the same cumulative histogram.

    A counter reset (the process restarted, so a bucket shrank) makes the older scrape useless:
    the newer one is returned whole, as Prometheus' ``increase`` would treat it.
    """
    out: dict[float, float] = {}
    for bound, count in newer.items():
        before = older.get(bound, 0.0)
        if count < before:
            return dict(newer)
        out[bound] = count - before
    return out


def add(into: dict[float, float], other: Buckets) -> dict[float, float]:
    """Sums histograms of several frontends bucket by bucket (same bounds expected)."""
    for bound, count in other.items():
        into[bound] = into.get(bound, 0.0) + count
    return into


def percentiles(buckets: Buckets, qs: Sequence[float] = (0.5, 0.99)) -> tuple[float | None, ...]:
    return tuple(quantile(q, buckets) for q in qs)
