"""The one percentile definition (shared/stats.py): numpy's default on random samples, the edges
every report relies on (p0 is the minimum, p100 the maximum, an even count's median is the mean of
the middle two), and nearest rank for decisions that must land on an observed value."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dynamod.shared.stats import nearest_rank, percentile, percentile_of_sorted, percentiles


def test_linear_interpolation_matches_numpy_default_on_random_samples() -> None:
    rng = random.Random(29)
    for _ in range(200):
        values = [rng.uniform(-1e3, 1e3) for _ in range(rng.randint(1, 60))]
        qs = [0.0, 0.5, 0.9, 0.99, 0.999, 1.0, rng.random()]
        expected = np.percentile(values, [q * 100 for q in qs])
        assert percentiles(values, qs) == pytest.approx(list(expected), rel=1e-12, abs=1e-9)


def test_known_answers() -> None:
    assert percentile([4, 1, 3, 2], 0.5) == 2.5  # even count: mean of the middle two
    assert percentile([1, 2, 3], 0.5) == 2
    assert percentile(range(1, 101), 0.99) == pytest.approx(99.01)  # not simply the largest
    assert percentile([7, 3, 5], 0.0) == 3 and percentile([7, 3, 5], 1.0) == 7
    assert percentile_of_sorted([1.0, 2.0, 4.0], 0.75) == 3.0


def test_no_values_gives_the_default() -> None:
    assert percentile([], 0.99) == 0.0
    assert percentiles([], (0.5, 0.99), default=-1.0) == [-1.0, -1.0]


@pytest.mark.parametrize("q", [-0.1, 1.5, 99, float("nan")])
def test_a_percent_or_out_of_range_quantile_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        percentile([1.0, 2.0], q)
    with pytest.raises(ValueError, match="fraction"):
        nearest_rank([1, 2], q)


def test_nearest_rank_is_an_observed_value() -> None:
    burst_of_a_tenth = [1] * 9 + [3]
    assert nearest_rank(burst_of_a_tenth, 0.9) == 1  # rank 9 of 10: exactly a tenth does not count
    assert nearest_rank([1] * 8 + [3, 3], 0.9) == 3  # more than a tenth does
    assert nearest_rank([5], 0.9) == 5
    assert nearest_rank([2, 9, 4], 0.0) == 2 and nearest_rank([2, 9, 4], 1.0) == 9
    rng = random.Random(7)
    for _ in range(200):
        values = [rng.randint(0, 20) for _ in range(rng.randint(1, 40))]
        q = rng.choice([0.5, 0.9, 0.95, rng.random()])
        got = nearest_rank(values, q)
        assert got in values
        assert sum(v <= got for v in values) >= q * len(values) - 1e-9  # at least q at or below
        assert sum(v < got for v in values) < q * len(values) or got == min(values)  # the smallest such


def test_nearest_rank_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        nearest_rank([], 0.9)
