"""Grid selection as Dynamo does it: buckets at and between cells, clamping, the middle-of-range
default target, priority overrides, and the retry order toward faster pools."""

from __future__ import annotations

import pytest

from dynamod.daemon.global_router.config import STAGE_AGG, STAGE_DECODE, STAGE_PREFILL, config_from_dict
from dynamod.daemon.global_router.pool_selection import (
    REASON_GRID,
    REASON_PRIORITY,
    RequestTraits,
    bucket,
    retry_order,
    select_pool,
)
from tests.unit.global_router.grids import agg_grid, disagg_grid


@pytest.mark.parametrize(
    ("value", "expected"),
    [(-5, 0), (0, 0), (249.99, 0), (250, 1), (499, 1), (500, 2), (999, 3), (1000, 3), (10**9, 3)],
)
def test_bucket_edges_belong_to_the_upper_cell_and_outside_values_clamp(value: float, expected: int) -> None:
    assert bucket(value, 0, 1000, 4) == expected


@pytest.mark.parametrize(
    ("isl", "ttft", "pool", "cell"),
    [
        (999, 109.9, 0, (0, 0)),  # first ISL bucket, tight TTFT
        (999, 110.0, 1, (0, 1)),  # TTFT exactly at the second bucket's edge
        (1000, 210.0, 1, (1, 1)),  # ISL at the second bucket's edge
        (2000, 500.0, 0, (2, 1)),  # long prompts go to the fast pool whatever the target
        (50_000, 0.0, 0, (3, 0)),  # clamped on both axes
    ],
)
def test_prefill_grid_reads_isl_then_ttft(isl: int, ttft: float, pool: int, cell: tuple[int, int]) -> None:
    stage = config_from_dict(disagg_grid()).stages[STAGE_PREFILL]
    choice = select_pool(stage, RequestTraits(isl=isl, ttft_target_ms=ttft))
    assert (choice.pool, choice.cell, choice.reason) == (pool, cell, REASON_GRID)


def test_prefill_without_target_uses_the_middle_of_the_ttft_range() -> None:
    stage = config_from_dict(disagg_grid()).stages[STAGE_PREFILL]
    choice = select_pool(stage, RequestTraits(isl=10))
    assert choice.ttft_target_ms == 110.0 and choice.cell == (0, 1) and choice.pool == 1


@pytest.mark.parametrize(
    ("context", "itl", "pool", "cell"),
    [(3999, 14.9, 0, (0, 0)), (3999, 25.0, 1, (0, 2)), (4000, 25.0, 0, (1, 2)), (4000, 45.0, 1, (1, 3)), (0, 1.0, 0, (0, 0))],
)
def test_decode_grid_reads_context_length_then_itl(context: int, itl: float, pool: int, cell: tuple[int, int]) -> None:
    stage = config_from_dict(disagg_grid()).stages[STAGE_DECODE]
    choice = select_pool(stage, RequestTraits(isl=context, itl_target_ms=itl))
    assert (choice.pool, choice.cell) == (pool, cell)
    assert choice.ttft_target_ms is None  # the decode grid has no TTFT axis


def test_decode_without_target_uses_the_middle_of_the_itl_range() -> None:
    stage = config_from_dict(disagg_grid()).stages[STAGE_DECODE]
    assert select_pool(stage, RequestTraits(isl=10)).itl_target_ms == 25.0


@pytest.mark.parametrize(
    ("traits", "pool", "cell"),
    [
        (RequestTraits(isl=100), 1, (0, 1, 0)),  # short, default TTFT (500: relaxed) -> slow
        (RequestTraits(isl=100, ttft_target_ms=100), 0, (0, 0, 0)),  # short, tight TTFT -> fast
        (RequestTraits(isl=600, ttft_target_ms=900), 0, (1, 1, 0)),  # long -> fast
        (RequestTraits(isl=100, ttft_target_ms=499.9, itl_target_ms=1000), 0, (0, 0, 0)),
    ],
)
def test_agg_grid_with_isl_reads_isl_ttft_itl(traits: RequestTraits, pool: int, cell: tuple[int, ...]) -> None:
    stage = config_from_dict(agg_grid()).stages[STAGE_AGG]
    choice = select_pool(stage, traits)
    assert (choice.pool, choice.cell) == (pool, cell)


def test_agg_grid_without_isl_is_ttft_by_itl() -> None:
    grid = agg_grid()
    strategy = grid["agg_pool_selection_strategy"]
    for key in ("isl_min", "isl_max", "isl_resolution"):
        del strategy[key]
    strategy.update(itl_resolution=2, agg_pool_mapping=[[0, 1], [1, 1]])
    stage = config_from_dict(grid).stages[STAGE_AGG]
    assert select_pool(stage, RequestTraits(isl=10**6, ttft_target_ms=10, itl_target_ms=10)).pool == 0
    assert select_pool(stage, RequestTraits(isl=0, ttft_target_ms=10, itl_target_ms=50)).pool == 1
    assert select_pool(stage, RequestTraits(isl=0, ttft_target_ms=600, itl_target_ms=10)).cell == (1, 0)


@pytest.mark.parametrize(("priority", "pool", "reason"), [(None, 1, REASON_GRID), (9, 1, REASON_GRID),
                                                         (10, 0, REASON_PRIORITY), (100, 0, REASON_PRIORITY),
                                                         (101, 1, REASON_GRID)])
def test_priority_override_bounds_are_inclusive(priority: int | None, pool: int, reason: str) -> None:
    stage = config_from_dict(agg_grid()).stages[STAGE_AGG]
    choice = select_pool(stage, RequestTraits(isl=100, priority=priority))
    assert (choice.pool, choice.reason, choice.grid_pool) == (pool, reason, 1)


def test_first_matching_override_wins_even_when_it_names_the_grids_pool() -> None:
    grid = agg_grid()
    grid["agg_pool_selection_strategy"]["priority_overrides"] = [
        {"min_priority": 0, "max_priority": 5, "target_pool": 1},
        {"min_priority": 0, "max_priority": 100, "target_pool": 0},
    ]
    stage = config_from_dict(grid).stages[STAGE_AGG]
    assert select_pool(stage, RequestTraits(isl=100, priority=3)).pool == 1
    assert select_pool(stage, RequestTraits(isl=100, priority=3)).reason == REASON_PRIORITY
    assert select_pool(stage, RequestTraits(isl=100, priority=50)).pool == 0


@pytest.mark.parametrize(
    ("selected", "priorities", "enabled", "order"),
    [
        (2, [0, 1, 2], True, [2, 1, 0]),  # slowest first among the faster ones
        (0, [0, 1, 2], True, [0]),  # already the fastest
        (2, [0, 1, 2], False, [2]),  # retry off
        (3, [0, 1, 1, 2], True, [3, 1, 2, 0]),  # equal priorities in pool order
        (0, [2, 0, 1], True, [0, 2, 1]),  # priorities, not pool order, say what is faster
        (1, [5, 5], True, [1]),  # an equally fast pool is not a faster one
    ],
)
def test_retry_order_walks_toward_faster_pools(selected: int, priorities: list[int], enabled: bool, order: list[int]) -> None:
    assert retry_order(selected, priorities, enabled) == order
