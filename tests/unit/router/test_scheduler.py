"""The cost function, exact ties, tie-breaking and temperature sampling."""

from __future__ import annotations

import math
import random
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from dynamod.daemon.router.core.active_sequences import ActiveSequences
from dynamod.daemon.router.core.scheduler import KvScheduler, weight_ratio
from dynamod.shared.kv.indexer import OverlapScores
from dynamod.shared.protocol.routing import (
    REASON_LOWEST_COST,
    REASON_SAMPLED,
    REASON_TIE_RANDOM,
    REASON_TIE_SMALLEST_TREE,
    CandidateScore,
)

BS = 16
W1, W2, W3 = (1, 0), (2, 0), (3, 0)


def _background(active: ActiveSequences, rid: str, worker, *, blocks: int, prefill_tokens: int) -> None:
    """A request already running on ``worker``: ``blocks`` active blocks (unique hashes) and
    ``prefill_tokens`` not yet prefilled."""
    seq = [hash((rid, i)) & 0xFFFFFFFF for i in range(blocks)]
    active.add(rid, worker, seq, blocks * BS, prefill_tokens)


def test_worked_example_picks_the_cheapest_worker():
    """Costs 8+10, 5+5 and 2+9 (weight 1): the second worker (10) beats 11 and 18."""
    active = ActiveSequences(BS)
    # The request: 4 full blocks (64 tokens).
    isl = 4 * BS
    seq = list(range(100, 104))
    # W1: nothing cached: 4 blocks to prefill + 4 queued = 8; decode 6 active + 4 new = 10.
    _background(active, "a", W1, blocks=6, prefill_tokens=4 * BS)
    # W2: all 4 cached: prefill 0 + 5 queued = 5; decode 5 active + 0 new (all cached) = 5.
    _background(active, "b", W2, blocks=5, prefill_tokens=5 * BS)
    # W3: 2 cached: 2 to prefill, nothing queued = 2; decode 7 active + 2 new = 9.
    _background(active, "c", W3, blocks=7, prefill_tokens=0)
    overlaps = OverlapScores({W2: 4, W3: 2}, {W1: 0, W2: 4, W3: 2})
    sched = KvScheduler(BS, random.Random(0))
    scores, keys = sched.score([W1, W2, W3], overlaps, active, isl=isl, seq_hashes=seq, overlap_weight=1.0)
    assert [(s.prefill_blocks, s.decode_blocks, s.cost) for s in scores] == [(8, 10, 18), (5, 5, 10), (2, 9, 11)]
    sel = sched.select(scores, keys, temperature=0.0)
    assert scores[sel.index].worker_id == 2
    assert sel.reason == REASON_LOWEST_COST
    assert "next 11.000" in sel.detail


def test_weight_scales_only_the_prefill_term():
    active = ActiveSequences(BS)
    _background(active, "a", W1, blocks=3, prefill_tokens=0)
    overlaps = OverlapScores({W1: 2}, {W1: 2, W2: 0})
    sched = KvScheduler(BS, random.Random(0))
    scores, _ = sched.score([W1, W2], overlaps, active, isl=2 * BS + 8, seq_hashes=[7, 8], overlap_weight=2.0)
    # W1: 8 uncached tokens = 0.5 block of prefill; decode 3 active + 1 new (the tail; two cached).
    assert (scores[0].prefill_blocks, scores[0].decode_blocks, scores[0].cost) == (0.5, 4, 5.0)
    # W2: all 40 tokens = 2.5 blocks; decode 3.
    assert (scores[1].prefill_blocks, scores[1].decode_blocks, scores[1].cost) == (2.5, 3, 8.0)


def test_blocks_cached_on_the_worker_are_not_new():
    active = ActiveSequences(BS)
    sched = KvScheduler(BS, random.Random(0))
    overlaps = OverlapScores({W1: 3}, {W1: 3, W2: 0})
    scores, _ = sched.score([W1, W2], overlaps, active, isl=4 * BS, seq_hashes=[1, 2, 3, 4], overlap_weight=1.0)
    assert [s.decode_blocks for s in scores] == [1, 4]


def test_blocks_shared_with_active_requests_are_not_new():
    active = ActiveSequences(BS)
    active.add("a", W1, [1, 2, 3], 3 * BS, 0)  # an active request with the same first 2 blocks
    sched = KvScheduler(BS, random.Random(0))
    overlaps = OverlapScores({}, {})
    scores, _ = sched.score([W1], overlaps, active, isl=4 * BS, seq_hashes=[1, 2, 9, 10], overlap_weight=1.0)
    assert scores[0].decode_blocks == 3 + 2


def test_ties_are_exact_with_decimal_weights():
    """0.1 * 1 + 5 and 0.1 * 41 + 1 are both 5.1; in binary floats the second is larger, which
    would hand the win to the wrong rule. The tie must go to the smaller tree."""
    active = ActiveSequences(BS)
    _background(active, "a", W1, blocks=5, prefill_tokens=BS)  # W1: 1 block queued, 5 active
    _background(active, "b", W2, blocks=0, prefill_tokens=40 * BS)  # W2: 40 blocks queued
    overlaps = OverlapScores({W1: 1}, {W1: 1, W2: 0})
    sched = KvScheduler(BS, random.Random(0))
    scores, keys = sched.score([W1, W2], overlaps, active, isl=BS, seq_hashes=[5], overlap_weight=0.1)
    assert (scores[0].prefill_blocks, scores[0].decode_blocks) == (1, 5)
    assert (scores[1].prefill_blocks, scores[1].decode_blocks) == (41, 1)
    assert 0.1 * 1 + 5 != 0.1 * 41 + 1  # the float trap is real
    assert keys[0] == keys[1]
    sel = sched.select(scores, keys, temperature=0.0)
    assert (scores[sel.index].worker_id, sel.reason) == (2, REASON_TIE_SMALLEST_TREE)


def test_weight_ratio_is_the_decimal_fraction():
    assert weight_ratio(1.0) == (1, 1)
    assert weight_ratio(0.1) == (1, 10)
    assert weight_ratio(2.5) == (5, 2)
    with pytest.raises(ValueError):
        weight_ratio(-1.0)


def _scored(costs: list[float], trees: list[int] | None = None) -> tuple[list[CandidateScore], list[int]]:
    trees = trees or [0] * len(costs)
    scores = [
        CandidateScore(
            worker_id=i + 1, dp_rank=0, overlap_blocks=0, prefill_tokens=0, prefill_blocks=0.0, decode_blocks=0, cost=c, tree_size=t
        )
        for i, (c, t) in enumerate(zip(costs, trees, strict=True))
    ]
    return scores, [int(c * 16) for c in costs]


def test_tie_goes_to_smallest_tree_then_random():
    sched = KvScheduler(BS, random.Random(7))
    scores, keys = _scored([5, 5, 6], trees=[9, 3, 0])
    sel = sched.select(scores, keys, 0.0)
    assert (sel.index, sel.reason) == (1, REASON_TIE_SMALLEST_TREE)

    picks = Counter()
    for _ in range(400):
        scores, keys = _scored([5, 5, 5, 6], trees=[3, 3, 4, 0])
        sel = sched.select(scores, keys, 0.0)
        assert sel.reason == REASON_TIE_RANDOM
        picks[sel.index] += 1
    assert set(picks) == {0, 1}  # never the bigger tree, never the costlier worker
    assert min(picks.values()) > 150


def _chi_square(observed: Counter, expected: list[float]) -> float:
    n = sum(observed.values())
    return sum((observed[i] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))


def test_temperature_sampling_follows_the_softmax():
    sched = KvScheduler(BS, random.Random(1234))
    costs = [10.0, 11.0, 12.0, 14.0]
    temperature = 0.5
    span = max(costs) - min(costs)
    raw = [math.exp(-(c - min(costs)) / (span * temperature)) for c in costs]
    expected = [r / sum(raw) for r in raw]
    counts = Counter()
    n = 20_000
    for _ in range(n):
        scores, keys = _scored(costs)
        sel = sched.select(scores, keys, temperature)
        counts[sel.index] += 1
    assert sel.reason == REASON_SAMPLED
    assert [round(s.probability, 6) for s in scores] == [round(p, 6) for p in expected]
    # 3 degrees of freedom: 16.27 is the 0.999 quantile.
    assert _chi_square(counts, expected) < 16.27, (counts, expected)


def test_temperature_with_equal_costs_is_uniform():
    sched = KvScheduler(BS, random.Random(99))
    counts = Counter()
    for _ in range(9_000):
        scores, keys = _scored([3.0, 3.0, 3.0])
        counts[sched.select(scores, keys, 2.0).index] += 1
    assert _chi_square(counts, [1 / 3] * 3) < 13.82  # 2 dof, 0.999 quantile


def test_high_temperature_flattens_low_temperature_sharpens():
    def share_of_best(t: float) -> float:
        sched = KvScheduler(BS, random.Random(5))
        wins = 0
        for _ in range(3000):
            scores, keys = _scored([1.0, 2.0])
            wins += sched.select(scores, keys, t).index == 0
        return wins / 3000

    assert share_of_best(0.05) > 0.99
    assert 0.45 < share_of_best(100.0) < 0.55


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.integers(0, 6), min_size=2, max_size=40), trees=st.data())
def test_selection_matches_a_stable_sort(keys, trees):
    """The winner, runner-up and tie handling equal those of a stable sort by cost, candidate
    order breaking ties (the selection avoids sorting, so it is checked against one)."""
    sizes = trees.draw(st.lists(st.integers(0, 3), min_size=len(keys), max_size=len(keys)))
    scores = [CandidateScore(i, 0, 0, k, float(k), 0, float(k), sizes[i]) for i, k in enumerate(keys)]
    sel = KvScheduler(BS, random.Random(0)).select(scores, keys, 0.0)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    tied = [i for i in order if keys[i] == keys[order[0]]]
    if len(tied) == 1:
        assert (sel.index, sel.reason) == (order[0], REASON_LOWEST_COST)
        assert f"(worker {order[1]} dp 0)" in sel.detail
    else:
        smallest = min(sizes[i] for i in tied)
        candidates = [i for i in tied if sizes[i] == smallest]
        assert sel.index in candidates
        assert sel.reason == (REASON_TIE_SMALLEST_TREE if len(candidates) == 1 else REASON_TIE_RANDOM)
