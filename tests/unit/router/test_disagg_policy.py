"""Conditional disaggregation decisions on constructed states: the cost policy, Dynamo's three, the
configuration, and the numbers a decision explains itself with (labelled, worker ids in hex)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from dynamod.daemon.perf.mocker_timing import decode_time_ms, prefill_time_ms
from dynamod.daemon.router.core.disagg_cost import (
    BANDWIDTH_CONFIG,
    BANDWIDTH_MEASURED,
    MockerCompute,
    PathOverhead,
    TransferEstimate,
    stall_ms,
)
from dynamod.daemon.router.core.disagg_policy import (
    POLICY_COST,
    REASON_COST_LOCAL,
    REASON_COST_REMOTE,
    REASON_ISL_ABOVE,
    REASON_ISL_BOUNDING,
    DisaggInputs,
    DisaggPolicyConfig,
    add_disagg_args,
    decide,
    disagg_config_from_args,
)
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.routing import DISAGG_LOCAL, DISAGG_REMOTE, DisaggInfo, RoutingDecision

COST = DisaggPolicyConfig(enabled=True)
MOCKER = MockerCompute()
PREFILL_W = 0x0ABC  # an id whose hex form starts with zeros once padded
DECODE_W = 0x1234_5678_9ABC_DEF0


def cost(**kw: object) -> DisaggInfo:
    inputs = DisaggInputs(prefill_worker_id=PREFILL_W, decode_worker_id=DECODE_W, **kw)  # type: ignore[arg-type]
    return decide(COST, inputs, MOCKER)


# -- the cost policy ---------------------------------------------------------------------------


def test_cost_is_the_default_conditional_policy() -> None:
    assert COST.policy == POLICY_COST and COST.name == POLICY_COST
    assert DisaggPolicyConfig().name == "always"


def test_short_fresh_prompt_is_prefilled_locally() -> None:
    info = cost(isl=16, running_decodes=4, decode_kv_fraction=0.1)
    assert (info.mode, info.reason) == (DISAGG_LOCAL, REASON_COST_LOCAL)
    c = info.cost
    assert c is not None and c.local_cost_ms <= c.remote_cost_ms
    assert c.local_prefill_tokens == c.remote_prefill_tokens == 16


def test_long_fresh_prompt_goes_remote_even_to_an_idle_decode_worker() -> None:
    for running in (0, 8):
        info = cost(isl=5000, running_decodes=running, decode_kv_fraction=0.1)
        assert (info.mode, info.reason) == (DISAGG_REMOTE, REASON_COST_REMOTE), info
        assert info.cost is not None and info.cost.local_cost_ms > info.cost.remote_cost_ms


def test_cached_long_prompt_is_prefilled_locally() -> None:
    # The decode worker holds 4,992 of 5,000 tokens: 8 to compute there, 5,000 to move otherwise.
    info = cost(isl=5000, decode_cached_tokens=4992, running_decodes=8, decode_kv_fraction=0.2)
    assert info.mode == DISAGG_LOCAL and info.effective_isl == 8
    # Even when the prefill worker caches it too: the decode worker then computes as little and
    # nothing has to travel or wait for the decode worker's next step.
    both = cost(isl=5000, decode_cached_tokens=4992, prefill_cached_tokens=4992, running_decodes=8, decode_kv_fraction=0.2)
    assert both.mode == DISAGG_LOCAL and both.cost is not None and both.cost.remote_prefill_tokens == 8


def test_overloaded_prefill_pool_sends_the_prompt_local() -> None:
    idle = cost(isl=3000, running_decodes=2, decode_kv_fraction=0.1)
    assert idle.mode == DISAGG_REMOTE
    busy = cost(isl=3000, running_decodes=2, decode_kv_fraction=0.1, prefill_load=60_000)
    assert (busy.mode, busy.reason) == (DISAGG_LOCAL, REASON_COST_LOCAL)
    assert busy.cost is not None and busy.cost.remote_queued_tokens == 60_000 and busy.cost.remote_queue_ms > 1000


def test_overloaded_decode_worker_sends_the_prompt_remote() -> None:
    idle = cost(isl=16)
    assert idle.mode == DISAGG_LOCAL
    busy = cost(isl=16, decode_queued_tokens=40_000, running_decodes=30, decode_kv_fraction=0.6)
    assert (busy.mode, busy.reason) == (DISAGG_REMOTE, REASON_COST_REMOTE)
    assert busy.cost is not None and busy.cost.local_queued_tokens == 40_000


def test_cost_terms_add_up_from_the_mocker_timing_model() -> None:
    info = cost(isl=1000, decode_cached_tokens=200, running_decodes=3, decode_kv_fraction=0.25,
                prefill_cached_tokens=500, prefill_load=2000, decode_queued_tokens=100)
    c = info.cost
    assert c is not None
    step = decode_time_ms(0.25)
    local = prefill_time_ms(100) + prefill_time_ms(800)  # the 100 queued in a step of their own, then 800 uncached
    assert c.local_compute_ms == pytest.approx(local, abs=1e-3)
    assert c.local_ttft_ms == pytest.approx(local + 2 * step, abs=1e-3)  # each step rides a decode step
    assert c.local_interference_ms == pytest.approx(3 * (prefill_time_ms(800) - prefill_time_ms(1)), abs=1e-2)
    assert c.remote_compute_ms == pytest.approx(prefill_time_ms(2000) + prefill_time_ms(500), abs=1e-3)  # queued, then 500 uncached
    assert c.remote_queue_ms == pytest.approx(prefill_time_ms(2000), abs=1e-2)
    assert c.transfer_bytes == 800 * COST.kv_bytes_per_token
    assert c.transfer_ms == pytest.approx(1.0 + 800 * COST.kv_bytes_per_token / 25e9 * 1000, abs=1e-3)
    assert c.decode_start_ms == pytest.approx(step + prefill_time_ms(100), abs=1e-3)
    assert c.remote_ttft_ms == pytest.approx(c.remote_compute_ms + c.transfer_ms + c.decode_start_ms, abs=1e-2)
    assert c.bandwidth_source == BANDWIDTH_CONFIG and c.compute_model == "mocker"


def test_chunked_transfer_counts_only_the_part_left_when_the_prefill_ends() -> None:
    # 40k tokens, the decode worker caching the first 24,576 (three 8,192-token chunks): the rest
    # moves while the prefill worker computes the last two chunks, so only the last chunk's blocks
    # (7,232 tokens, ~38 ms at 25 GB/s) and the latency wait after it. Moved after the prefill, the
    # whole 15,424 tokens (~81 ms) wait and the decode worker's own prefill is cheaper.
    state = {"isl": 40_000, "decode_cached_tokens": 3 * 8192, "running_decodes": 2, "decode_kv_fraction": 0.1}
    after = cost(**state)
    chunked = cost(**state, transfer=dataclasses.replace(COST.transfer, overlap="chunk"))
    assert after.mode == DISAGG_LOCAL and chunked.mode == DISAGG_REMOTE
    a, c = after.cost, chunked.cost
    assert a is not None and c is not None
    per_token_ms = COST.kv_bytes_per_token / 25e9 * 1000
    assert a.transfer_exposed_ms == a.transfer_ms == pytest.approx(1.0 + 15_424 * per_token_ms, abs=1e-3)
    assert c.transfer_ms == a.transfer_ms and c.transfer_overlap == "chunk" and a.transfer_overlap == "none"
    assert c.transfer_exposed_ms == pytest.approx(1.0 + 7_232 * per_token_ms, abs=1e-3)
    assert c.remote_ttft_ms == pytest.approx(c.remote_compute_ms + c.transfer_exposed_ms + c.decode_start_ms, abs=1e-2)
    # A link slower than the compute: the bytes queue up, and the exposed part grows to match.
    slow = dataclasses.replace(COST.transfer, overlap="chunk", bandwidth_gb_s=1.0)
    compute_ms = MOCKER.prefill_ms(40_000)
    link_ms = 15_424 * COST.kv_bytes_per_token / 1e9 * 1000
    starts = MOCKER.prefill_ms(4 * 8192)  # the 4th chunk's end: the first lacking block's start
    assert slow.exposed_ms(MOCKER, 40_000, 3 * 8192, 0) == pytest.approx(starts + link_ms - compute_ms + 1.0, abs=1e-3)


def test_ties_go_local() -> None:
    # No interference weight, an instant transfer, a free decode start: remote and local cost the
    # same compute; the tie keeps the prompt where it is.
    cfg = DisaggPolicyConfig(enabled=True, interference_weight=0.0, transfer_latency_ms=0.0, transfer_bandwidth_gb_s=1e12)

    class NoDecodeStep(MockerCompute):
        def decode_step_ms(self, kv_fraction: float) -> float:
            return 0.0

    info = decide(cfg, DisaggInputs(isl=500, prefill_worker_id=1), NoDecodeStep())
    assert info.cost is not None and info.cost.local_cost_ms == pytest.approx(info.cost.remote_cost_ms, abs=1e-2)
    assert info.mode == DISAGG_LOCAL


def test_measured_overhead_of_the_remote_path_tips_short_prompts_local() -> None:
    plain = cost(isl=100, running_decodes=8, decode_kv_fraction=0.1)
    assert plain.mode == DISAGG_REMOTE
    overhead = PathOverhead()
    for _ in range(PathOverhead.MIN_SAMPLES):
        overhead.observe(100, measured_ms=80.0, predicted_ms=18.0)
    assert overhead.ms(100) == pytest.approx(62.0)
    slow = cost(isl=100, running_decodes=8, decode_kv_fraction=0.1, remote_overhead_ms=overhead.ms(100))
    assert slow.mode == DISAGG_LOCAL and slow.cost is not None and slow.cost.remote_overhead_ms == pytest.approx(62.0)
    # The local path's own measured extra cost counts on its side, in its TTFT.
    both = cost(isl=100, running_decodes=8, decode_kv_fraction=0.1, remote_overhead_ms=62.0, local_overhead_ms=70.0)
    assert both.mode == DISAGG_REMOTE and both.cost is not None
    assert both.cost.local_ttft_ms == pytest.approx(slow.cost.local_ttft_ms + 70.0, abs=1e-3)


def test_the_profile_compute_model_agrees_with_the_mocker_it_was_measured_on() -> None:
    profile = COST.profile_compute()
    for tokens in (16, 100, 1000, 5000, 8000):
        assert profile.prefill_ms(tokens) == pytest.approx(MOCKER.prefill_ms(tokens), rel=0.05, abs=0.5)
    assert profile.decode_step_ms(0.1) == pytest.approx(MOCKER.decode_step_ms(0.1), rel=0.05)
    assert stall_ms(profile, 16) < 1.0 < stall_ms(profile, 5000)


def test_transfer_latency_is_measured_when_the_decode_worker_reports_transfers() -> None:
    config = TransferEstimate(kv_bytes_per_token=1000, bandwidth_gb_s=1.0, latency_ms=1.0)
    assert config.measured(0.0, 500) is config and config.measured(4.0, 0) is config  # nothing measured yet
    # Its median transfer took 40 ms; the median transfer sent its way was 500 tokens (0.5 ms of bytes).
    m = config.measured(40.0, 500)
    assert m.source == BANDWIDTH_MEASURED and m.latency_ms == pytest.approx(39.5)
    assert m.time_ms(m.bytes_for(500)) == pytest.approx(40.0)
    assert m.time_ms(m.bytes_for(50_000)) == pytest.approx(39.5 + 50.0)  # not 100 x 40 ms
    assert config.measured(0.1, 500).latency_ms == 1.0  # never below the configured floor
    info = decide(COST, DisaggInputs(isl=16, prefill_worker_id=1, transfer=m), MOCKER)
    assert info.cost is not None and info.cost.bandwidth_source == BANDWIDTH_MEASURED


def test_path_overhead_is_learned_per_prompt_size_and_ages_out() -> None:
    now = [0.0]
    overhead = PathOverhead(max_age_s=60.0, clock=lambda: now[0])
    for _ in range(10):
        overhead.observe(100, measured_ms=80.0, predicted_ms=25.0)  # a short prompt's hops: 55 ms
        overhead.observe(6000, measured_ms=150.0, predicted_ms=160.0)  # a long one's queue overestimated
    assert overhead.ms(90) == pytest.approx(55.0)  # same class (within a factor of 4)
    assert overhead.ms(5000) == 0.0  # below its prediction: no negative cost
    assert overhead.ms(1500) == 0.0 and overhead.samples(1500) == 0  # nothing known at this size
    overhead.observe(100, measured_ms=5000.0, predicted_ms=25.0)  # one stall nobody saw: 1 in 11
    assert overhead.ms(100) == pytest.approx(55.0)  # the 90th percentile, not the mean
    for _ in range(2):
        overhead.observe(100, measured_ms=200.0, predicted_ms=25.0)  # misses this often price the path
    assert overhead.ms(100) == pytest.approx(175.0)
    now[0] = 61.0
    assert overhead.samples(100) == 0 and overhead.ms(100) == 0.0  # stale: the path is tried again
    overhead.observe(100, measured_ms=float("nan"), predicted_ms=1.0)
    assert overhead.samples(100) == 0


def test_an_unmeasured_path_is_tried_a_few_times_then_left_until_measured() -> None:
    now = [0.0]
    remote = PathOverhead(explore_window_s=10.0, clock=lambda: now[0])
    for i in range(PathOverhead.MIN_SAMPLES):
        assert remote.may_explore(100)
        remote.explored(100, predicted_ms=30.0)
        # One at a time: the next once this one's predicted first token is due.
        assert not remote.may_explore(100) and remote.may_explore(6000)  # per size class
        now[0] += 0.03 if i < PathOverhead.MIN_SAMPLES - 1 else 5.0
    assert not remote.may_explore(100)  # four within the window: the path is being measured
    # The policy then takes the other path, and says why.
    plain = cost(isl=100, running_decodes=8, decode_kv_fraction=0.1)
    assert plain.mode == DISAGG_REMOTE
    held = cost(isl=100, running_decodes=8, decode_kv_fraction=0.1, remote_measuring=True)
    assert held.mode == DISAGG_LOCAL and "remote path at this prompt size still being measured" in held.detail
    both = cost(isl=100, running_decodes=8, decode_kv_fraction=0.1, remote_measuring=True, local_measuring=True)
    assert both.mode == DISAGG_LOCAL  # both unmeasured: as a tie
    long_ = cost(isl=6000, running_decodes=8, decode_kv_fraction=0.1, local_measuring=True)
    assert long_.mode == DISAGG_REMOTE and "still being measured" not in long_.detail  # nothing to change
    # The local path being measured hands a prompt it predicts cheaper only to a measured remote
    # path: an unmeasured one is priced without its overhead.
    short = {"isl": 100, "decode_kv_fraction": 0.1, "local_measuring": True}
    assert cost(**short).mode == DISAGG_LOCAL
    diverted = cost(**short, remote_measured=True)
    assert diverted.mode == DISAGG_REMOTE and "local path at this prompt size still being measured" in diverted.detail
    now[0] = 10.2
    assert remote.may_explore(100)  # the window passed: another few may go
    for _ in range(PathOverhead.MIN_SAMPLES):
        remote.observe(100, measured_ms=80.0, predicted_ms=25.0)
    remote.explored(100)  # measured now: nothing is counted
    assert remote.measured(100) and remote.may_explore(100)


# -- Dynamo's policies ---------------------------------------------------------------------------


def test_isl_bounding_keeps_a_short_fresh_prompt_local() -> None:
    cfg = DisaggPolicyConfig(enabled=True, policy="isl_bounding", eff_isl_threshold=512)
    short = decide(cfg, DisaggInputs(isl=16, prefill_worker_id=1))
    assert (short.mode, short.reason) == (DISAGG_LOCAL, REASON_ISL_BOUNDING)
    assert "prompt 16 < 512" in short.detail
    fresh_long = decide(cfg, DisaggInputs(isl=5600, prefill_worker_id=1))
    assert (fresh_long.mode, fresh_long.reason) == (DISAGG_REMOTE, REASON_ISL_ABOVE)
    # A prompt at least as long as the threshold: the ratio still decides.
    mostly_fresh = decide(cfg, DisaggInputs(isl=600, decode_cached_tokens=150, prefill_worker_id=1))
    assert mostly_fresh.mode == DISAGG_REMOTE and "ratio 0.75 not below 0.70" in mostly_fresh.detail
    mostly_cached = decide(cfg, DisaggInputs(isl=600, decode_cached_tokens=500, prefill_worker_id=1))
    assert (mostly_cached.mode, mostly_cached.reason) == (DISAGG_LOCAL, REASON_ISL_BOUNDING)


def test_config_json_selects_and_validates_the_policy() -> None:
    parser = argparse.ArgumentParser()
    add_disagg_args(parser)
    args = parser.parse_args(["--router-conditional-disagg", "--router-conditional-disagg-config",
                              '{"policy": "isl_or_load", "interference_weight": 0.5, "transfer_bandwidth_gb_s": 12.5}'])
    cfg = disagg_config_from_args(args)
    assert (cfg.policy, cfg.interference_weight, cfg.transfer_bandwidth_gb_s) == ("isl_or_load", 0.5, 12.5)
    assert disagg_config_from_args(parser.parse_args(["--router-conditional-disagg"])).policy == POLICY_COST
    # The decode stage of a remote prompt: the router's weight by default, Dynamo's 0 on request.
    assert cfg.decode_overlap_weight(remote=True) is None and cfg.decode_overlap_weight(remote=False) is None
    dynamo = disagg_config_from_args(parser.parse_args(["--router-conditional-disagg-config", '{"remote_decode_overlap_weight": 0}']))
    assert dynamo.decode_overlap_weight(remote=True) == 0.0 and dynamo.decode_overlap_weight(remote=False) is None
    for bad, words in (('{"interference_weight": -1}', "interference_weight"), ('{"policy": "fastest"}', "unknown"),
                       ('{"transfer_bandwidth_gb_s": 0}', "transfer_bandwidth_gb_s"), ('{"foo": 1}', "unknown fields"),
                       ('{"remote_decode_overlap_weight": -1}', "remote_decode_overlap_weight")):
        with pytest.raises(ConfigError, match=words):
            disagg_config_from_args(parser.parse_args(["--router-conditional-disagg-config", bad]))
    with pytest.raises(ConfigError, match="not found"):
        DisaggPolicyConfig(enabled=True, perf_profile="/nonexistent/profile.json").profile_compute()


# -- route explain -----------------------------------------------------------------------------


def _arrays(value: object) -> list[object]:
    """Every list in ``value`` whose items are not labelled objects."""
    found: list[object] = []
    if isinstance(value, dict):
        for v in value.values():
            found += _arrays(v)
    elif isinstance(value, list):
        if any(not isinstance(item, dict) for item in value):
            found.append(value)
        for item in value:
            found += _arrays(item)
    return found


def test_route_explain_labels_every_number_and_prints_ids_in_hex() -> None:
    from dynamod.shared.protocol.routing import CandidateScore

    decision = RoutingDecision(
        request_id="r", worker_id=DECODE_W, dp_rank=0, overlap_blocks=2, request_blocks=3, isl=48, reason="lowest_cost",
        detail="", overlap_weight=1.0, temperature=0.0,
        candidates=[CandidateScore(DECODE_W, 0, 2, 16, 1.0, 1, 2.0, 2), CandidateScore(0x5, 0, 0, 48, 3.0, 3, 6.0, 0, None, 1, 0, 0.75)],
        busy=[(0x7, 0, "decode_blocks")], stage="decode",
        disagg=cost(isl=48, running_decodes=1, decode_kv_fraction=0.1),
    )
    body = json.loads(decision.to_header())
    assert _arrays(body) == []
    assert body["schema"] == 2 and body["worker_id"] == "123456789abcdef0"
    assert [c["worker_id"] for c in body["candidates"]] == ["123456789abcdef0", "0000000000000005"]
    assert body["candidates"][1]["host_overlap_blocks"] == 1 and "host_overlap_blocks" not in body["candidates"][0]
    assert body["busy"] == [{"worker_id": "0000000000000007", "dp_rank": 0, "reason": "decode_blocks"}]
    disagg = body["disagg"]
    assert disagg["prefill_worker_id"] == "0000000000000abc" and disagg["decode_worker_id"] == "123456789abcdef0"
    assert len({len(v) for k, v in disagg.items() if k.endswith("worker_id")}) == 1
    assert {"local_cost_ms", "remote_cost_ms", "transfer_bytes", "bandwidth_gb_s", "local_interference_ms",
            "remote_queue_ms", "decode_start_ms"} <= set(disagg["cost"])
    assert disagg["detail"].startswith("local ") and disagg["mode"] in (DISAGG_LOCAL, DISAGG_REMOTE)
