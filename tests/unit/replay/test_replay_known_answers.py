"""Replay figures worked out by hand from the timing model, for every router mode, agg and disagg.

The trace is three requests far enough apart that each finds every worker idle: R0 (4 blocks, 3
output tokens) at 0 ms, R1 (the same prompt) at 1 s, R2 (2 other blocks, 2 tokens) at 2 s. Where a
request runs, whether it hits a cached prefix, and so every TTFT, inter-token gap and step follow
from the routing policy alone:

- a prompt of n blocks prefills in one step of ``prefill_time_ms(n * 16)``; a repeat of a cached
  prompt recomputes only its last block (the last token is always computed): ``prefill_time_ms(16)``;
- its first decoded token opens block n + 1, so each decode step takes ``decode_time_ms((n + 1) / 256)``.
"""

from __future__ import annotations

import random

import pytest

from dynamod.daemon.perf.mocker_timing import decode_time_ms, prefill_time_ms
from dynamod.daemon.replay.simulator import MODES, TransferModel, replay, replay_disagg
from tests.unit.replay.helpers import BLOCK, mocker, requests

P64, P32, P16 = prefill_time_ms(64), prefill_time_ms(32), prefill_time_ms(16)
D5, D3 = decode_time_ms(5 / 256), decode_time_ms(3 / 256)  # R0/R1 decode with 5 blocks held, R2 with 3
ITLS = [D5, D5, D5, D5, D3]  # R0 and R1 two gaps each, R2 one
OUTPUT_TOKENS = 3 + 3 + 2
PROMPT_TOKENS = 64 + 64 + 32


def three_requests() -> list:
    return requests((0.0, [0, 1, 2, 3], 3), (1000.0, [0, 1, 2, 3], 3), (2000.0, [10, 11], 2))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def assert_figures(res: dict, *, ttfts: list[float], e2es: list[float], busy_ms: float, workers: int,
                   cached_tokens: int) -> None:
    """Every client figure of the three-request trace against hand-computed values."""
    sim_s = (2000.0 + e2es[2]) / 1000.0  # first arrival at 0, R2 finishes last
    approx = pytest.approx
    assert res["completed"] == 3
    assert res["ttft_ms"]["mean"] == approx(sum(ttfts) / 3, abs=1e-3)
    assert res["ttft_ms"]["p50"] == approx(percentile(ttfts, 0.5), abs=1e-3)
    assert res["ttft_ms"]["p99"] == approx(percentile(ttfts, 0.99), abs=1e-3)
    assert res["itl_ms"]["mean"] == approx(sum(ITLS) / 5, abs=1e-3)
    assert res["itl_ms"]["p50"] == approx(D5, abs=1e-3)
    assert res["itl_ms"]["p999"] == approx(D5, abs=1e-3)
    assert res["e2e_ms"]["mean"] == approx(sum(e2es) / 3, abs=1e-3)
    assert res["e2e_ms"]["p99"] == approx(percentile(e2es, 0.99), abs=1e-3)
    assert res["sim_s"] == approx(sim_s, abs=1e-3)
    assert res["requests_per_s"] == approx(3 / sim_s, abs=1e-3)
    assert res["output_tokens_per_s"] == approx(OUTPUT_TOKENS / sim_s, abs=0.05)
    assert res["cache_hit_rate"] == approx(cached_tokens / PROMPT_TOKENS, abs=1e-4)
    assert res["decode_step_ms"]["mean"] == approx(sum(ITLS) / 5, abs=1e-3)
    assert res["decode_step_ms"]["with_prefill_frac"] == 0.0
    busy = res["busy_fraction"]
    total = busy["agg"] if "agg" in busy else busy["decode"]
    assert total == approx(busy_ms / (workers * sim_s * 1000.0), abs=1e-4)


def agg_expectation(placement: list[int]) -> dict:
    """Figures for an aggregated replay on 2 workers given where R0, R1, R2 ran."""
    r1_hits = placement[1] == placement[0]
    p1 = P16 if r1_hits else P64
    ttfts = [P64, p1, P32]
    e2es = [P64 + 2 * D5, p1 + 2 * D5, P32 + D3]
    return {"ttfts": ttfts, "e2es": e2es, "busy_ms": sum(e2es), "cached_tokens": 48 if r1_hits else 0}


@pytest.mark.parametrize("mode", MODES)
def test_agg_three_requests_every_mode(mode: str) -> None:
    seed = 3
    res = replay(three_requests(), workers=2, mode=mode, mocker=mocker(), seed=seed)
    if mode == "round-robin":
        placement = [0, 1, 0]
    elif mode == "random":
        rng = random.Random(seed)  # the picker's own generator: one draw per request
        placement = [rng.randrange(2) for _ in range(3)]
    else:
        # R0 breaks a tie at random; R1 follows its cached prompt; R2 caches nothing anywhere and
        # goes to the worker with the smaller cached tree, the other one.
        first = res["requests_per_worker"].index(max(res["requests_per_worker"]))
        placement = [first, first, 1 - first]
    assert res["requests_per_worker"] == [placement.count(0), placement.count(1)]
    assert_figures(res, workers=2, **agg_expectation(placement))


BYTES_PER_TOKEN = 1000


def slow_link() -> TransferModel:
    """1 byte per microsecond plus 2 ms: a 64-token prompt (64,000 bytes) moves in 66 ms."""
    return TransferModel(kv_bytes_per_token=BYTES_PER_TOKEN, bandwidth_gb_s=0.001, latency_ms=2.0)


def transfer_ms(blocks: int) -> float:
    return 2.0 + blocks * BLOCK * BYTES_PER_TOKEN / 1000.0


@pytest.mark.parametrize("mode", ["kv", "round-robin"])
def test_disagg_three_requests(mode: str) -> None:
    res = replay_disagg(three_requests(), prefill_workers=2, decode_workers=2, mode=mode, mocker=mocker(),
                        transfer=slow_link(), seed=3)
    if mode == "kv":
        # R1 prefills where R0 did (only its last block) and decodes where R0 did, which caches
        # the whole prompt already: nothing travels but the fixed latency.
        prefill = [P64, P16, P32]
        moved = [4, 0, 2]
        cached = 48
    else:
        # Both pools take turns: R1 lands on the other prefill and decode worker, and R2 back on
        # the first ones, which cache nothing of its prompt.
        prefill = [P64, P64, P32]
        moved = [4, 4, 2]
        cached = 0
    transfers = [transfer_ms(b) for b in moved]
    # The decode worker samples the first token as the KV lands: a chunk of transferred prompt
    # costs no compute, so TTFT is prefill plus transfer.
    ttfts = [p + t for p, t in zip(prefill, transfers, strict=True)]
    e2es = [ttfts[0] + 2 * D5, ttfts[1] + 2 * D5, ttfts[2] + D3]
    assert_figures(res, ttfts=ttfts, e2es=e2es, busy_ms=sum(ITLS), workers=2, cached_tokens=cached)
    d = res["disagg"]
    assert (d["remote"], d["local"]) == (3, 0)
    assert d["transfer_bytes_total"] == sum(moved) * BLOCK * BYTES_PER_TOKEN
    assert d["transfer_ms"]["mean"] == pytest.approx(sum(transfers) / 3, abs=1e-3)
    assert d["remote_prefill_ms"]["mean"] == pytest.approx(sum(prefill) / 3, abs=1e-3)
    assert res["busy_fraction"]["prefill"] == pytest.approx(sum(prefill) / (2 * res["sim_s"] * 1000.0), abs=1e-4)
    per_worker = res["requests_per_worker"]
    assert sorted(per_worker["prefill"]) == sorted(per_worker["decode"]) == [1, 2]


def test_chunked_prefill_then_batched_decode_on_one_worker() -> None:
    """A 64-token prompt in 32-token chunks, and a second request joining its decode batch."""
    small_budget = mocker(max_num_batched_tokens=32)
    trace = requests((0.0, [0, 1, 2, 3], 4), (1.0, [10], 3))
    res = replay(trace, workers=1, mode="kv", mocker=small_budget)
    # Step 1 [0, P32]: R0's first chunk (R1 arrives meanwhile and waits).
    # Step 2: R0's second chunk (32 tokens fill the budget; R1 cannot join): R0's first token.
    s2_end = 2 * P32
    # Step 3: R0 decodes (opening its 5th block) and R1 prefills its 16 tokens (its one block, plus
    # the one its first token will need later): 5 + 1 blocks are held while it runs.
    s3_end = s2_end + P16 + decode_time_ms(6 / 256)
    # Step 4 and 5: both decode; R1's first decoded token opens its second block (7 held).
    s4_end = s3_end + decode_time_ms(7 / 256)
    s5_end = s4_end + decode_time_ms(7 / 256)  # R0's 4th token (done) and R1's 3rd (done)
    ttfts = [s2_end, s3_end - 1.0]
    assert res["ttft_ms"]["mean"] == pytest.approx(sum(ttfts) / 2, abs=1e-3)
    assert res["e2e_ms"]["mean"] == pytest.approx((s5_end + s5_end - 1.0) / 2, abs=1e-3)
    itls = [s3_end - s2_end, s4_end - s3_end, s5_end - s4_end, s4_end - s3_end, s5_end - s4_end]
    assert res["itl_ms"]["mean"] == pytest.approx(sum(itls) / len(itls), abs=1e-3)
    assert res["decode_step_ms"]["with_prefill_frac"] == pytest.approx(1 / 3, abs=1e-4)
    assert res["busy_fraction"]["agg"] == pytest.approx(s5_end / s5_end, abs=1e-4)
