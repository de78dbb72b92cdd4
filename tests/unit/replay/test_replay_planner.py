"""Replay with the planner in the loop: it scales up under a burst and back down after, and the
figures it reports (attainment, worker-seconds, the static baseline) are counted right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamod.daemon.cli import main as cli_main
from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.planner.load_policy import LoadPolicy, LoadPolicyConfig, ReplicaBudget
from dynamod.daemon.planner.policy import Observation, PoolPlan
from dynamod.daemon.replay.planner_loop import ReplayPlanner, compare_static, peak_workers, static_allocations
from dynamod.daemon.replay.report import RequestStats, sla_figures
from dynamod.daemon.replay.simulator import _Pool, replay, replay_disagg

from .helpers import mocker, requests, write_trace

BURST = (10_000.0, 25_000.0)  # one request every 50 ms in here, one a second outside


def burst_rows() -> list[tuple[float, list[int], int]]:
    rows, t, i = [], 0.0, 0
    while t < 60_000:
        rows.append((t, [100_000 + i * 50 + k for k in range(8)], 40))
        t += 50.0 if BURST[0] <= t < BURST[1] else 1000.0
        i += 1
    return rows


def load_planner(mode: str = "agg", **budget: int) -> ReplayPlanner:
    policy = LoadPolicy(LoadPolicyConfig(mode=mode, interval_s=2.0, optimization_target="latency",
                                         grace_period_s=10.0, context_length=2048, startup_s=2.0,
                                         budget=ReplicaBudget(max_gpu_budget=4, **budget)))
    return ReplayPlanner(policy, startup_s=2.0)


def test_load_planner_scales_up_in_the_burst_and_down_after() -> None:
    reqs = requests(*burst_rows())
    planner = load_planner()
    res = replay(reqs, workers=1, mode="kv", mocker=mocker(), planner=planner, sla_targets=(500.0, 50.0))
    assert res["completed"] == len(reqs)  # draining lost nothing
    timeline = res["planner"]["timeline"]
    ups = [e["t_s"] for e in timeline if e["action"] == "scale_up"]
    downs = [e["t_s"] for e in timeline if e["action"] == "scale_down"]
    assert ups and BURST[0] / 1000 <= ups[0] <= BURST[0] / 1000 + 6  # within a few intervals of the burst
    assert downs and min(downs) >= BURST[1] / 1000 and max(downs) <= BURST[1] / 1000 + 20
    assert res["planner"]["peak_workers"]["agg"] >= 3
    # worker-seconds: far less than the peak fleet held for the whole run, more than one worker
    span = max(r.arrival_ms for r in reqs) / 1000
    assert span < res["worker_seconds"] < res["planner"]["peak_workers"]["agg"] * span
    assert res["worker_seconds"] == res["planner"]["worker_seconds"]["agg"]


def test_disaggregated_replay_with_the_planner_keeps_both_pools() -> None:
    reqs = requests(*burst_rows())
    res = replay_disagg(reqs, prefill_workers=1, decode_workers=1, mode="kv", mocker=mocker(),
                        planner=load_planner("disagg"), sla_targets=(500.0, 50.0))
    assert res["completed"] == len(reqs)
    assert set(res["planner"]["worker_seconds"]) == {"prefill", "decode"}
    assert res["planner"]["scale_ups"] >= 1


class _Script:
    """A policy that asks for a fixed count per tick: the loop's mechanics, alone."""

    name = "script"
    interval_s = 1.0

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def plan(self, observation: Observation) -> dict[str, PoolPlan]:
        n = self.counts.pop(0) if self.counts else 1
        return {"agg": PoolPlan("agg", n)}


def test_scale_up_counts_only_after_startup_and_scale_down_drains() -> None:
    reqs = requests(*[(t * 100.0, [500 + t * 10 + k for k in range(4)], 30) for t in range(60)])
    planner = ReplayPlanner(_Script([3, 3, 3, 1]), startup_s=1.5)
    res = replay(reqs, workers=1, mode="round-robin", mocker=mocker(), planner=planner, sla_targets=(1e9, 1e9))
    assert res["completed"] == len(reqs)
    assert res["sla"]["attainment_pct"] == 100.0
    assert res["planner"]["launched"] == {"agg": 3}
    assert res["planner"]["peak_workers"] == {"agg": 3}
    assert res["requests_per_worker"][1] > 0 and min(res["requests_per_worker"]) > 0


def test_worker_seconds_and_peak_count_launch_to_stop() -> None:
    pool = _Pool.create("agg", 1, MockerConfig(num_gpu_blocks=16, block_size=16, vocab_size=100))
    pool.launched_ms += [1000.0, 2000.0]
    pool.stopped_ms += [4000.0, -1.0]
    assert pool.worker_seconds(10_000.0) == pytest.approx(10 + 3 + 8)
    assert peak_workers(pool, 10_000.0) == 3


def test_sla_attainment_needs_both_targets() -> None:
    def st(ttft: float, gaps: list[float]) -> RequestStats:
        times = [ttft]
        for g in gaps:
            times.append(times[-1] + g)
        return RequestStats(arrival_ms=0.0, prompt_tokens=1, token_times=times)

    done = [st(100, [10, 10]), st(900, [10]), st(100, [80, 80]), st(100, [])]
    fig = sla_figures(done, ttft_ms=500, itl_ms=50)
    # ok, TTFT miss, ITL miss (mean 80), one token (TTFT only, ok)
    assert (fig["attainment_pct"], fig["ttft_ok_pct"], fig["itl_ok_pct"]) == (50.0, 75.0, 75.0)


def test_static_comparison_picks_best_and_cheapest_matching() -> None:
    assert static_allocations(ReplicaBudget(max_gpu_budget=3), disagg=False) == [{"agg": 1}, {"agg": 2}, {"agg": 3}]
    assert {"prefill": 1, "decode": 2} in static_allocations(ReplicaBudget(max_gpu_budget=3), disagg=True)
    figures = {1: (40.0, 100.0), 2: (90.0, 200.0), 3: (90.0, 300.0)}

    def run(alloc: dict[str, int]) -> dict:
        att, ws = figures[alloc["agg"]]
        return {"sla": {"attainment_pct": att}, "worker_seconds": ws}

    cmp = compare_static(static_allocations(ReplicaBudget(max_gpu_budget=3), disagg=False), run, planner_attainment=85.0)
    assert cmp.best is not None and cmp.best.allocation == {"agg": 2}  # ties: fewer worker-seconds
    assert cmp.cheapest_matching is not None and cmp.cheapest_matching.allocation == {"agg": 2}
    assert compare_static([{"agg": 1}], run, 95.0).cheapest_matching is None


def test_cli_replay_with_planner_and_static_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", burst_rows()[:120])
    code = cli_main(["replay", "--trace", str(trace), "--trace-block-size", "16", "--block-size", "16",
                     "--num-gpu-blocks", "256", "--max-num-seqs", "16", "--planner", "load", "--adjustment-interval", "2",
                     "--optimization-target", "latency", "--context-length", "2048", "--startup-delay", "2",
                     "--max-gpu-budget", "3", "--compare-static", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["planner"]["policy"] == "load" and "attainment_pct" in out["sla"]
    assert [r["allocation"] for r in out["static"]["runs"]] == [{"agg": 1}, {"agg": 2}, {"agg": 3}]
    assert out["static"]["best"]["attainment_pct"] >= max(r["attainment_pct"] for r in out["static"]["runs"])


def test_traffic_counts_arrivals_like_the_live_planner() -> None:
    """The replayed frontend reports arrivals (finished + growth of in-flight), as the live scrape
    does: a saturated fleet's demand is more than what it finishes."""
    from dynamod.daemon.replay.planner_loop import traffic_sample

    assert traffic_sample([], 10.0, arrivals=7).num_requests == 7
    assert traffic_sample([], 10.0, arrivals=-3).num_requests == 0  # in-flight draining: none came
    assert traffic_sample([], 10.0).num_requests == 0
