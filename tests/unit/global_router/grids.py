"""Grid configs shared by the global router's unit tests (plain dicts, as a JSON file holds them)."""

from __future__ import annotations

from typing import Any


def agg_grid(**overrides: Any) -> dict[str, Any]:
    """Two agg pools, ``fast`` (0) and ``slow`` (1), over ISL x TTFT x ITL:
    long prompts (ISL >= 512) always go fast; short ones go fast only with a TTFT target under 500 ms."""
    grid: dict[str, Any] = {
        "mode": "agg",
        "num_agg_pools": 2,
        "agg_pool_dynamo_namespaces": ["fast", "slow"],
        "agg_pool_selection_strategy": {
            "isl_min": 0, "isl_max": 1024, "isl_resolution": 2,
            "ttft_min_ms": 0, "ttft_max_ms": 1000, "ttft_resolution": 2,
            "itl_min_ms": 0, "itl_max_ms": 100, "itl_resolution": 1,
            "agg_pool_mapping": [[[0], [1]], [[0], [0]]],
            "priority_overrides": [{"min_priority": 10, "max_priority": 100, "target_pool": 0}],
        },
    }  # fmt: skip
    grid.update(overrides)
    return grid


def disagg_grid(**overrides: Any) -> dict[str, Any]:
    """Prefill pools p0 (fast), p1 (slow) over ISL x TTFT; decode pools d0, d1 over context x ITL."""
    grid: dict[str, Any] = {
        "num_prefill_pools": 2,
        "num_decode_pools": 2,
        "prefill_pool_dynamo_namespaces": ["p0", "p1"],
        "decode_pool_dynamo_namespaces": ["d0", "d1"],
        "prefill_pool_selection_strategy": {
            "isl_min": 0, "isl_max": 4000, "isl_resolution": 4,
            "ttft_min_ms": 10, "ttft_max_ms": 210, "ttft_resolution": 2,
            "prefill_pool_mapping": [[0, 1], [0, 1], [0, 0], [0, 0]],
        },
        "decode_pool_selection_strategy": {
            "context_length_min": 0, "context_length_max": 8000, "context_length_resolution": 2,
            "itl_min_ms": 5, "itl_max_ms": 45, "itl_resolution": 4,
            "decode_pool_mapping": [[0, 0, 1, 1], [0, 0, 0, 1]],
        },
    }  # fmt: skip
    grid.update(overrides)
    return grid
