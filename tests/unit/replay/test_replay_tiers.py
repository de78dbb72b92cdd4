"""Replay with host/disk KV tiers: a prefix pushed off the device is onboarded, not recomputed,
and the report says which tier served it; the fast path gives the step-by-step figures."""

from __future__ import annotations

from dynamod.daemon.replay.simulator import replay
from tests.unit.replay.helpers import mocker, requests


def _trace():
    # A's 8 blocks, then B's 8 (the device holds 10: A leaves it), then A again.
    a, b = list(range(1, 9)), list(range(101, 109))
    return requests((0.0, a, 4), (2000.0, b, 4), (4000.0, a + [200], 4))


def test_tiers_turn_a_recompute_into_an_onboard_and_report_it() -> None:
    gpu = replay(_trace(), workers=1, mode="kv", mocker=mocker(num_gpu_blocks=10))
    tiered = replay(_trace(), workers=1, mode="kv", mocker=mocker(num_gpu_blocks=10, num_host_blocks=16))
    assert "kv_tiers" not in gpu
    assert tiered["cache_hit_rate"] > gpu["cache_hit_rate"]
    tiers = tiered["kv_tiers"]
    assert tiers["hit_rate"]["CPU"] > 0 and tiers["onboarded_blocks"]["CPU"] >= 6
    assert tiered["ttft_ms"]["mean"] < gpu["ttft_ms"]["mean"]  # onboarding 8 blocks beats prefilling them


def test_tiered_replay_fast_path_matches_step_by_step() -> None:
    config = mocker(num_gpu_blocks=10, num_host_blocks=4, num_disk_blocks=8)
    fast = replay(_trace(), workers=1, mode="kv", mocker=config, fast_forward=True)
    slow = replay(_trace(), workers=1, mode="kv", mocker=config, fast_forward=False)
    assert fast == slow
