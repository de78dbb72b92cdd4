"""Stretches of plain decode steps run at once give the step-by-step replay's figures exactly.

``fast_forward=False`` is the reference: every core steps one step per event. The fast replay must
match it for every request (each token's time, to the last bit) and every figure, in every routing
mode, aggregated and disaggregated, with the planner in the loop, under memory pressure
(preemption, eviction) and with events falling on the same instant.
"""

from __future__ import annotations

import pytest

from dynamod.daemon.replay.simulator import MODES, TransferModel, _Simulation
from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from tests.unit.replay.helpers import mixed_trace, mocker, ragged_trace, requests
from tests.unit.replay.test_replay_planner import burst_rows, load_planner


def _run(trace: list, *, fast: bool, planner_mode: str | None = None, **kw: object) -> _Simulation:
    kw.setdefault("transfer", TransferModel())
    kw.setdefault("router_config", None)
    kw.setdefault("policy", None)
    kw.setdefault("prefill_workers", 0)
    planner = load_planner(planner_mode) if planner_mode else None
    sim = _Simulation(fast_forward=fast, planner=planner, sla_targets=(500.0, 50.0), **kw)  # type: ignore[arg-type]
    sim.run(trace)
    return sim


def assert_same_replay(make_trace, **kw: object) -> dict:
    """Runs the reference and the fast replay; every request's record and the report must agree."""
    ref = _run(make_trace(), fast=False, **kw)
    fast = _run(make_trace(), fast=True, **kw)
    assert ref.stats.keys() == fast.stats.keys()
    for rid, want in ref.stats.items():
        assert fast.stats[rid] == want, rid
    mode = kw["mode"]
    report = ref.report(mode)  # type: ignore[arg-type]
    assert fast.report(mode) == report  # type: ignore[arg-type]
    for pool in ("decode", "prefill"):
        a, b = getattr(ref, pool), getattr(fast, pool)
        assert [c.simulated_ms for c in a.cores] == [c.simulated_ms for c in b.cores]
        assert [c.num_steps for c in a.cores] == [c.num_steps for c in b.cores]
    for picker in ("decode_picker", "prefill_picker"):
        a, b = getattr(ref, picker), getattr(fast, picker)
        if a is not None:
            # The router heard the same number of KV events from each worker and holds the same blocks.
            assert a._event_ids == b._event_ids
            assert held_blocks(a) == held_blocks(b)
    return report


def held_blocks(picker) -> set[tuple[int, int]]:
    if picker.router is None:
        return set()
    return {(ev.worker_id, b.block_hash) for ev in picker.router.indexer.dump_events() for b in ev.event.blocks}


TRACES = {"whole-blocks": mixed_trace, "ragged": ragged_trace}


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("mode", MODES)
def test_agg_every_mode_under_memory_pressure(mode: str, trace: str) -> None:
    # 60 blocks of 16 tokens for 3 workers' worth of overlapping requests: preemption and eviction.
    report = assert_same_replay(lambda: TRACES[trace](80), decode_workers=3, mode=mode,
                                mocker=mocker(num_gpu_blocks=60), seed=2)
    assert report["completed"] == 80


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("mode", MODES)
def test_disagg_every_mode(mode: str, trace: str) -> None:
    report = assert_same_replay(lambda: TRACES[trace](80), prefill_workers=2, decode_workers=2, mode=mode,
                                mocker=mocker(num_gpu_blocks=80), policy=DisaggPolicyConfig(enabled=True),
                                transfer=TransferModel(1000, 0.01, 1.0), seed=4)
    assert report["disagg"]["remote"] > 0 and report["disagg"]["local"] > 0


@pytest.mark.parametrize("overlap", ["chunk", "layer", "none"])
def test_disagg_with_chunked_prefills_and_transfers(overlap: str) -> None:
    # 64-token chunks: most prompts prefill in several steps, so a chunk-wise transfer moves
    # blocks at every step and several transfers share a decode worker's link.
    report = assert_same_replay(lambda: ragged_trace(80), prefill_workers=2, decode_workers=2, mode="kv",
                                mocker=mocker(num_gpu_blocks=80, max_num_batched_tokens=64),
                                policy=DisaggPolicyConfig(enabled=True),
                                transfer=TransferModel(1000, 0.01, 1.0, overlap=overlap), seed=4)
    assert report["completed"] == 80 and report["disagg"]["remote"] > 0
    exposed, whole = report["disagg"]["exposed_transfer_ms"], report["disagg"]["transfer_ms"]
    assert (exposed == whole) if overlap == "none" else (exposed["mean"] < whole["mean"])


def test_with_the_planner_scaling_the_pool() -> None:
    report = assert_same_replay(lambda: requests(*burst_rows()[:120]), decode_workers=1, mode="kv", mocker=mocker(),
                                seed=0, planner_mode="agg")
    assert any(e["action"] == "scale_up" for e in report["planner"]["timeline"])


def lockstep_trace() -> list:
    """Workers in lockstep: equal prompts at the same instants on different workers, so their
    steps end at identical times; outputs of different lengths end their stretches at different
    steps, so a visible step of one falls on an inner step of another's stretch; a request
    arriving at a busy worker cuts its stretch short."""
    rows = []
    for burst in range(3):
        t = burst * 400.0
        for w in range(4):
            rows.append((t, [50 * burst + w * 7 + k for k in range(3)], 12 + 9 * w))
    rows.append((150.0, [999, 998], 5))
    return requests(*rows)


def test_simultaneous_steps_on_lockstep_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    cuts = {"tie": 0}
    real_cut = _Simulation._cut_runs_at

    def counting_cut(self: _Simulation, at: float) -> None:
        cuts["tie"] += 1
        real_cut(self, at)

    monkeypatch.setattr(_Simulation, "_cut_runs_at", counting_cut)
    for mode in ("round-robin", "kv"):
        assert_same_replay(lockstep_trace, decode_workers=4, mode=mode, mocker=mocker(), seed=1)
    assert cuts["tie"] > 0  # the instant-tie path ran, and still matched the reference
