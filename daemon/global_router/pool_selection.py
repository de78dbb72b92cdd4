"""Which pool a request goes to, and where it goes next if that pool fails: pure functions.

Dynamo's grid lookup, kept exactly so a config tuned against Dynamo routes the same here: each axis
``[min, max]`` is cut into ``resolution`` equal buckets, a value's bucket is
``clamp(int((value - min) / step), 0, resolution - 1)`` (values below the range land in the first
bucket, above it in the last), and a missing SLA target counts as the middle of its range. Then the
first ``priority_overrides`` rule whose inclusive range holds the request's priority replaces the
grid's pool. The retry order is the chosen pool, then the faster pools (lower priority number)
from the slowest of them to the fastest; pools of equal priority are tried in pool order.

No I/O and no clock here: the service measures, this decides, and tests check cells and edges
directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynamod.daemon.global_router.config import (
    AggStrategy,
    DecodeStrategy,
    PrefillStrategy,
    PriorityOverride,
    StagePools,
)

REASON_GRID = "grid"
REASON_PRIORITY = "priority_override"


@dataclass(frozen=True, slots=True)
class RequestTraits:
    """What the grid looks at: the prompt's token count (ISL, and the decode stage's
    ``context_length``), the SLA targets in ms (None: the config's middle) and the priority."""

    isl: int
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class PoolChoice:
    pool: int  # the pool the request goes to
    grid_pool: int  # the grid's answer (differs from ``pool`` when an override matched)
    reason: str  # REASON_GRID or REASON_PRIORITY
    cell: tuple[int, ...]  # the grid cell, in the mapping's index order
    ttft_target_ms: float | None  # the targets the grid used (after the middle-of-range default)
    itl_target_ms: float | None


def bucket(value: float, lo: float, hi: float, resolution: int) -> int:
    """The bucket of ``value`` on an axis cut into ``resolution`` equal steps (clamped)."""
    step = (hi - lo) / resolution
    return max(0, min(int((value - lo) / step), resolution - 1))


def _middle(lo: float, hi: float) -> float:
    return (lo + hi) / 2


def matching_override(priority: int | None, overrides: Sequence[PriorityOverride]) -> PriorityOverride | None:
    """The first rule whose ``[min_priority, max_priority]`` holds ``priority`` (it wins)."""
    if priority is None:
        return None
    for rule in overrides:
        if rule.min_priority <= priority <= rule.max_priority:
            return rule
    return None


def select_pool(pools: StagePools, traits: RequestTraits) -> PoolChoice:
    """The pool of ``traits`` in ``pools``'s grid, priority overrides applied."""
    s = pools.strategy
    ttft: float | None = None
    itl: float | None = None
    if isinstance(s, PrefillStrategy):
        ttft = _middle(s.ttft_min_ms, s.ttft_max_ms) if traits.ttft_target_ms is None else traits.ttft_target_ms
        cell: tuple[int, ...] = (
            bucket(traits.isl, s.isl_min, s.isl_max, s.isl_resolution),
            bucket(ttft, s.ttft_min_ms, s.ttft_max_ms, s.ttft_resolution),
        )
        grid_pool = s.prefill_pool_mapping[cell[0]][cell[1]]
    elif isinstance(s, DecodeStrategy):
        itl = _middle(s.itl_min_ms, s.itl_max_ms) if traits.itl_target_ms is None else traits.itl_target_ms
        cell = (
            bucket(traits.isl, s.context_length_min, s.context_length_max, s.context_length_resolution),
            bucket(itl, s.itl_min_ms, s.itl_max_ms, s.itl_resolution),
        )
        grid_pool = s.decode_pool_mapping[cell[0]][cell[1]]
    else:
        assert isinstance(s, AggStrategy)
        ttft = _middle(s.ttft_min_ms, s.ttft_max_ms) if traits.ttft_target_ms is None else traits.ttft_target_ms
        itl = _middle(s.itl_min_ms, s.itl_max_ms) if traits.itl_target_ms is None else traits.itl_target_ms
        cell = (bucket(ttft, s.ttft_min_ms, s.ttft_max_ms, s.ttft_resolution), bucket(itl, s.itl_min_ms, s.itl_max_ms, s.itl_resolution))
        if s.isl_min is not None and s.isl_max is not None and s.isl_resolution is not None:
            cell = (bucket(traits.isl, s.isl_min, s.isl_max, s.isl_resolution), *cell)
            grid_pool = s.agg_pool_mapping[cell[0]][cell[1]][cell[2]]
        else:
            grid_pool = s.agg_pool_mapping[cell[0]][cell[1]]
    # A matching rule decides the request even when it names the grid's own pool: report it so.
    rule = matching_override(traits.priority, s.priority_overrides)
    pool, reason = (grid_pool, REASON_GRID) if rule is None else (rule.target_pool, REASON_PRIORITY)
    return PoolChoice(pool=pool, grid_pool=grid_pool, reason=reason, cell=cell, ttft_target_ms=ttft, itl_target_ms=itl)


def retry_order(selected: int, priorities: Sequence[int], enabled: bool) -> list[int]:
    """``selected``, then the faster pools (lower priority number) from slowest to fastest.

    With retry off, or when ``selected`` is already the fastest, there is nowhere else to go."""
    if not enabled:
        return [selected]
    mine = priorities[selected]
    order = [selected]
    for level in sorted({p for p in priorities if p < mine}, reverse=True):
        order.extend(i for i, p in enumerate(priorities) if p == level)
    return order
