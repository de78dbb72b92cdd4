"""Aggregated replay: figures that can be worked out by hand, determinism, every routing mode."""

from __future__ import annotations

import pytest

from dynamod.daemon.perf.mocker_timing import decode_time_ms, prefill_time_ms
from dynamod.daemon.replay.simulator import MODES, replay
from tests.unit.replay.helpers import BLOCK, mixed_trace, mocker, requests

PROMPT = [0, 1, 2, 3]  # four blocks, 64 tokens


def test_lone_request_ttft_is_its_prefill_and_itl_its_decode_steps() -> None:
    res = replay(requests((0.0, PROMPT, 3)), workers=1, mode="kv", mocker=mocker())
    ttft = prefill_time_ms(4 * BLOCK)
    # After the prompt's 4 blocks, the first decoded token opens a 5th block out of 256.
    step = decode_time_ms(5 / 256)
    assert res["completed"] == 1
    assert res["ttft_ms"]["mean"] == pytest.approx(ttft, abs=1e-3)
    assert res["itl_ms"]["mean"] == pytest.approx(step, abs=1e-3)
    assert res["e2e_ms"]["mean"] == pytest.approx(ttft + 2 * step, abs=1e-3)
    assert res["cache_hit_rate"] == 0.0
    assert res["decode_step_ms"]["with_prefill_frac"] == 0.0


def test_a_request_arriving_during_a_step_waits_and_stalls_the_running_decode() -> None:
    res = replay(requests((0.0, [0, 1, 2, 3], 2), (0.0, [10, 11, 12, 13], 2)), workers=1, mode="kv", mocker=mocker())
    first = prefill_time_ms(64)  # the first arrival starts a step alone
    # The second prefills in the next step, which also decodes the first (5 + 4 blocks of 256).
    second_step = prefill_time_ms(64) + decode_time_ms(9 / 256)
    assert res["ttft_ms"]["mean"] == pytest.approx((first + first + second_step) / 2, abs=1e-3)
    # The first request's one gap is that whole step; the second's is a lone decode (5 blocks).
    assert res["itl_ms"]["mean"] == pytest.approx((second_step + decode_time_ms(5 / 256)) / 2, abs=1e-3)
    assert res["decode_step_ms"]["with_prefill_frac"] > 0.0


def test_kv_router_sends_a_repeated_prompt_to_the_worker_caching_it() -> None:
    trace = requests((0.0, PROMPT, 3), (1000.0, PROMPT, 3))
    kv = replay(trace, workers=2, mode="kv", mocker=mocker())
    # The repeat hits 3 of its 4 blocks (the last token is always recomputed): 48 of 128 tokens.
    assert kv["cache_hit_rate"] == pytest.approx(48 / 128)
    assert kv["requests_per_worker"] in ([2, 0], [0, 2])
    assert kv["ttft_ms"]["mean"] == pytest.approx((prefill_time_ms(64) + prefill_time_ms(16)) / 2, abs=1e-3)
    rr = replay(trace, workers=2, mode="round-robin", mocker=mocker())
    assert rr["requests_per_worker"] == [1, 1]
    assert rr["cache_hit_rate"] == 0.0
    assert rr["ttft_ms"]["mean"] == pytest.approx(prefill_time_ms(64), abs=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_figures(mode: str) -> None:
    trace = mixed_trace()
    first = replay(trace, workers=3, mode=mode, mocker=mocker(), seed=7)
    again = replay(mixed_trace(), workers=3, mode=mode, mocker=mocker(), seed=7)
    assert first == again


def test_random_routing_follows_the_seed() -> None:
    spreads = {tuple(replay(mixed_trace(), workers=3, mode="random", mocker=mocker(), seed=s)["requests_per_worker"])
               for s in range(4)}
    assert len(spreads) > 1


@pytest.mark.parametrize("mode", MODES)
def test_every_router_mode_completes_the_trace(mode: str) -> None:
    trace = mixed_trace()
    res = replay(trace, workers=3, mode=mode, mocker=mocker())
    assert res["completed"] == len(trace)
    assert sum(res["requests_per_worker"]) == len(trace)
    assert 0.0 < res["busy_fraction"]["agg"] <= 1.0
    assert res["ttft_ms"]["p50"] <= res["ttft_ms"]["p99"]


def test_kv_routing_reuses_more_prefix_than_round_robin() -> None:
    kv = replay(mixed_trace(), workers=4, mode="kv", mocker=mocker())
    rr = replay(mixed_trace(), workers=4, mode="round-robin", mocker=mocker())
    assert kv["cache_hit_rate"] > rr["cache_hit_rate"]
