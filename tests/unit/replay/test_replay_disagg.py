"""Disaggregated replay: transfer time, conditional disaggregation, fallback, determinism."""

from __future__ import annotations

import pytest

from dynamod.daemon.perf.mocker_timing import prefill_time_ms
from dynamod.daemon.replay.simulator import MODES, TransferModel, replay, replay_disagg
from dynamod.daemon.router.core.disagg_cost import MockerCompute, TransferEstimate
from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from dynamod.shared.errors import ConfigError
from tests.unit.replay.helpers import BLOCK, mixed_trace, mocker, requests

PROMPT = [0, 1, 2, 3]  # four blocks, 64 tokens
BYTES_PER_TOKEN = 1000
PROMPT_BYTES = 4 * BLOCK * BYTES_PER_TOKEN  # 64,000


def transfer(gb_s: float, latency_ms: float = 2.0) -> TransferModel:
    return TransferModel(kv_bytes_per_token=BYTES_PER_TOKEN, bandwidth_gb_s=gb_s, latency_ms=latency_ms)


def one_request(gb_s: float) -> dict:
    return replay_disagg(requests((0.0, PROMPT, 3)), prefill_workers=1, decode_workers=1, mode="kv",
                         mocker=mocker(), transfer=transfer(gb_s))


def test_remote_ttft_is_prefill_plus_transfer() -> None:
    res = one_request(0.001)  # 10^6 bytes/s: 64,000 bytes take 64 ms, plus 2 ms latency
    assert res["disagg"]["remote"] == 1
    assert res["disagg"]["transfer_bytes_total"] == PROMPT_BYTES
    assert res["disagg"]["transfer_ms"]["mean"] == pytest.approx(66.0)
    assert res["disagg"]["remote_prefill_ms"]["mean"] == pytest.approx(prefill_time_ms(64), abs=1e-3)
    # The decode worker samples the first token as the KV lands (nothing else runs there).
    assert res["ttft_ms"]["mean"] == pytest.approx(prefill_time_ms(64) + 66.0, abs=1e-3)
    assert res["completed"] == 1
    assert res["output_tokens_per_s"] > 0


def test_bandwidth_flag_scales_the_transfer_part_of_ttft() -> None:
    slow, fast = one_request(0.001), one_request(0.002)
    assert slow["ttft_ms"]["mean"] - fast["ttft_ms"]["mean"] == pytest.approx(32.0, abs=1e-3)


def test_blocks_the_decode_worker_caches_do_not_travel() -> None:
    trace = requests((0.0, PROMPT, 3), (1000.0, PROMPT, 3))
    res = replay_disagg(trace, prefill_workers=1, decode_workers=1, mode="kv", mocker=mocker(), transfer=transfer(0.001))
    assert res["disagg"]["remote"] == 2
    assert res["disagg"]["transfer_bytes_total"] == PROMPT_BYTES  # the repeat moved nothing
    assert res["disagg"]["transfer_ms"]["p50"] == pytest.approx((66.0 + 2.0) / 2)
    # The prefill worker cached the first prompt too: 48 of the repeat's 64 tokens were not computed.
    assert res["cache_hit_rate"] == pytest.approx(48 / 128)


def test_conditional_isl_bounding_prefills_a_cached_prompt_locally() -> None:
    trace = requests((0.0, PROMPT, 3), (1000.0, PROMPT, 3))
    policy = DisaggPolicyConfig(enabled=True, policy="isl_bounding", eff_isl_threshold=32)
    res = replay_disagg(trace, prefill_workers=1, decode_workers=1, mode="kv", mocker=mocker(),
                        policy=policy, transfer=transfer(0.001))
    d = res["disagg"]
    # First: nothing cached, effective isl 64 is not below 32: remote.
    # Repeat: the decode worker caches all of it, effective isl 0 (ratio 0.0): local.
    assert (d["remote"], d["local"]) == (1, 1)
    assert d["reasons"] == {"isl_above_threshold": 1, "isl_bounding": 1}
    assert d["transfer_bytes_total"] == PROMPT_BYTES
    assert res["policy"] == "isl_bounding"


def test_conditional_prefill_load_keeps_work_local_while_the_prefill_worker_is_busy() -> None:
    trace = requests((0.0, [0, 1, 2, 3], 2), (0.0, [10, 11, 12, 13], 2))
    policy = DisaggPolicyConfig(enabled=True, policy="prefill_load", prefill_busy_threshold=0)
    res = replay_disagg(trace, prefill_workers=1, decode_workers=1, mode="kv", mocker=mocker(), policy=policy,
                        transfer=transfer(25.0))
    # The second arrives while the prefill worker computes the first's 64 tokens (> 0 queued).
    assert res["disagg"]["reasons"] == {"prefill_busy": 1, "prefill_not_busy": 1}
    assert res["completed"] == 2


def test_short_uncached_prompts_go_remote_without_the_condition() -> None:
    trace = requests((0.0, PROMPT, 3), (1000.0, PROMPT, 3))
    res = replay_disagg(trace, prefill_workers=1, decode_workers=1, mode="kv", mocker=mocker(), transfer=transfer(1.0))
    assert res["disagg"]["reasons"] == {"always": 2}


def test_no_prefill_workers_with_fallback_is_the_agg_replay() -> None:
    trace = mixed_trace()
    agg = replay(trace, workers=3, mode="kv", mocker=mocker(), seed=5)
    dis = replay_disagg(mixed_trace(), prefill_workers=0, decode_workers=3, mode="kv", mocker=mocker(), seed=5)
    for key in ("completed", "ttft_ms", "itl_ms", "e2e_ms", "cache_hit_rate", "output_tokens_per_s", "decode_step_ms"):
        assert dis[key] == agg[key], key
    assert dis["requests_per_worker"]["decode"] == agg["requests_per_worker"]
    assert dis["disagg"]["reasons"] == {"no_prefill_workers": len(trace)}
    assert dis["disagg"]["transfer_bytes_total"] == 0


def test_no_prefill_workers_without_fallback_is_refused() -> None:
    with pytest.raises(ConfigError, match="no-decode-fallback"):
        replay_disagg(mixed_trace(), prefill_workers=0, decode_workers=2, mode="kv", mocker=mocker(),
                      policy=DisaggPolicyConfig(decode_fallback=False))


def test_long_prefills_stop_stalling_running_decodes() -> None:
    # A short stream is decoding when a 1,024-token prompt arrives. A big cache keeps decode steps
    # near their floor (their time grows with KV occupancy), so only a prefill can make one long.
    big = mocker(num_gpu_blocks=4096)
    trace = requests((0.0, [0], 40), (50.0, list(range(100, 164)), 2))
    agg = replay(trace, workers=1, mode="kv", mocker=big)
    dis = replay_disagg(requests((0.0, [0], 40), (50.0, list(range(100, 164)), 2)), prefill_workers=1,
                        decode_workers=1, mode="kv", mocker=big)
    stall = prefill_time_ms(1024)
    assert agg["decode_step_ms"]["with_prefill_frac"] > 0.0
    assert agg["itl_ms"]["p999"] > stall
    assert dis["decode_step_ms"]["with_prefill_frac"] == 0.0
    assert dis["itl_ms"]["p999"] < stall / 2


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_figures(mode: str) -> None:
    policy = DisaggPolicyConfig(enabled=True)
    runs = [replay_disagg(mixed_trace(), prefill_workers=2, decode_workers=2, mode=mode, mocker=mocker(),
                          policy=policy, transfer=transfer(0.01), seed=11) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0]["completed"] == len(mixed_trace())
    assert runs[0]["disagg"]["remote"] + runs[0]["disagg"]["local"] == len(mixed_trace())


def test_random_routing_follows_the_seed() -> None:
    spreads = {
        tuple(replay_disagg(mixed_trace(), prefill_workers=2, decode_workers=3, mode="random", mocker=mocker(),
                            seed=s)["requests_per_worker"]["decode"])
        for s in range(4)
    }
    assert len(spreads) > 1


def test_pool_busy_fractions_split_the_work() -> None:
    res = replay_disagg(mixed_trace(), prefill_workers=2, decode_workers=2, mode="kv", mocker=mocker())
    busy = res["busy_fraction"]
    assert 0.0 < busy["prefill"] <= 1.0 and 0.0 < busy["decode"] <= 1.0
    assert sum(res["requests_per_worker"]["prefill"]) == res["disagg"]["remote"] == len(mixed_trace())


@pytest.mark.parametrize(("weight", "moved"), [(0.0, 2 * PROMPT_BYTES), (None, PROMPT_BYTES)])
def test_remote_decode_stage_with_cache_credit_moves_fewer_bytes(weight: float | None, moved: int) -> None:
    # The first request decodes on one worker (5 active blocks by the time the repeat arrives);
    # the repeat's prompt is all cached there. With no cache credit (Dynamo's decode router) the
    # idle worker is cheaper (4 new blocks < 5 active ones) and the prompt travels again; with the
    # router's weight the cached worker wins and nothing travels.
    trace = requests((0.0, PROMPT, 200), (100.0, PROMPT, 3))
    policy = DisaggPolicyConfig(remote_decode_overlap_weight=weight)
    res = replay_disagg(trace, prefill_workers=1, decode_workers=2, mode="kv", mocker=mocker(),
                        policy=policy, transfer=transfer(1000.0))
    assert res["disagg"]["remote"] == 2
    assert res["disagg"]["transfer_bytes_total"] == moved


# Chunk-wise transfer: a 128-token prompt prefilled in four 32-token chunks; its blocks move at
# 1 ms per token (1000 bytes a token at 10^6 bytes/s), slower than a chunk computes (~17 ms).
LONG = list(range(500, 508))  # eight blocks, 128 tokens
CHUNK = 32


def chunked_replay(trace: list, overlap: bool, prefill_workers: int = 1) -> dict:
    model = TransferModel(kv_bytes_per_token=BYTES_PER_TOKEN, bandwidth_gb_s=0.001, latency_ms=2.0, overlap="chunk" if overlap else "none")
    return replay_disagg(trace, prefill_workers=prefill_workers, decode_workers=1, mode="kv",
                         mocker=mocker(max_num_batched_tokens=CHUNK), transfer=model)


def test_chunked_transfer_moves_each_chunk_as_it_is_computed() -> None:
    after, chunked = (chunked_replay(requests((0.0, LONG, 3)), overlap) for overlap in (False, True))
    chunk_ms = prefill_time_ms(CHUNK)
    # After the prefill: all 128 ms of bytes plus the latency. Chunked: the link starts with the
    # first chunk and stays busy (32 ms a chunk against ~17 ms of compute), so the last block lands
    # 128 ms after the first chunk's end; the prefill itself ended three chunks after that one.
    assert after["disagg"]["exposed_transfer_ms"]["mean"] == pytest.approx(130.0)
    exposed = chunk_ms + 128.0 - 4 * chunk_ms + 2.0
    assert chunked["disagg"]["exposed_transfer_ms"]["mean"] == pytest.approx(exposed, abs=1e-3)
    assert chunked["disagg"]["transfer_overlap"] == "chunk" and after["disagg"]["transfer_overlap"] == "none"
    # The same bytes move, in the same link time; only when they move differs, and TTFT with it.
    assert chunked["disagg"]["transfer_bytes_total"] == after["disagg"]["transfer_bytes_total"] == 128 * BYTES_PER_TOKEN
    assert chunked["disagg"]["transfer_ms"]["mean"] == pytest.approx(130.0)
    assert after["ttft_ms"]["mean"] - chunked["ttft_ms"]["mean"] == pytest.approx(130.0 - exposed, abs=2e-3)
    # The cost policy predicts the same exposed time from its own model of the chunks.
    estimate = TransferEstimate(BYTES_PER_TOKEN, 0.001, 2.0, overlap="chunk")
    assert estimate.exposed_ms(MockerCompute(CHUNK), 128, 0, 0) == pytest.approx(exposed)


def test_chunked_transfers_into_one_decode_worker_share_its_link() -> None:
    # Two prompts prefilled side by side on two prefill workers: their chunks queue on the one
    # decode worker's link in the order they are ready, so 256 ms of bytes follow the first chunk.
    trace = requests((0.0, LONG, 1), (0.0, [600 + k for k in range(8)], 1))
    shared = chunked_replay(trace, True, prefill_workers=2)
    assert shared["disagg"]["remote"] == 2
    chunk_ms = prefill_time_ms(CHUNK)
    assert shared["ttft_ms"]["p99"] >= chunk_ms + 256.0 + 2.0 - 1.0
    alone = chunked_replay(requests((0.0, LONG, 1)), True)
    assert shared["disagg"]["exposed_transfer_ms"]["mean"] > alone["disagg"]["exposed_transfer_ms"]["mean"] + 60.0


def test_layer_wise_transfer_overlaps_a_single_chunk() -> None:
    # One 64-token chunk (~17 ms of compute) whose 64 ms of bytes move layer by layer: the first of
    # 32 layers is ready 1/32 into the step, and the link, slower than the compute, runs from there.
    model = TransferModel(kv_bytes_per_token=BYTES_PER_TOKEN, bandwidth_gb_s=0.001, latency_ms=2.0, overlap="layer")
    res = replay_disagg(requests((0.0, PROMPT, 3)), prefill_workers=1, decode_workers=1, mode="kv", mocker=mocker(),
                        transfer=model)
    step = prefill_time_ms(64)
    exposed = step / 32 + 64.0 - step + 2.0
    assert res["disagg"]["transfer_overlap"] == "layer"
    assert res["disagg"]["exposed_transfer_ms"]["mean"] == pytest.approx(exposed, abs=1e-3)
    assert res["ttft_ms"]["mean"] == pytest.approx(step + exposed, abs=1e-3)
    estimate = TransferEstimate(BYTES_PER_TOKEN, 0.001, 2.0, overlap="layer")
    assert estimate.exposed_ms(MockerCompute(2048), 64, 0, 0) == pytest.approx(exposed)
    # A link faster than the compute leaves only the last layer's share after the step.
    fast = TransferEstimate(BYTES_PER_TOKEN, 1.0, 2.0, overlap="layer")
    assert fast.exposed_ms(MockerCompute(2048), 64, 0, 0) == pytest.approx(0.064 / 32 + 2.0)
    with pytest.raises(ConfigError, match="kv-transfer-overlap"):
        TransferModel(overlap="sometimes")
