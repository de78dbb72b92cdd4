"""The ``dynamod up`` scaler's decisions (``plan_scaling``: which workers to start and which to
stop for a desired count) and the supervisor under it: a worker added later is restarted when it
crashes like the first ones, a retired one is stopped and never restarted, and a retire that lands
while a crashed child is being restarted leaves no process behind."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import pytest

from dynamod.daemon.perf.profile import PerfProfile, default_profile_path
from dynamod.daemon.supervisor.children import ChildSpec, CrashLoopPolicy, Supervisor
from dynamod.daemon.supervisor.scaler import PoolBudget, RunningWorker, plan_scaling
from dynamod.daemon.supervisor.up import (
    WorkerFactory,
    add_args,
    build_specs,
    resolve_scaling,
    runtime_flags,
    scaling_budget,
    scaling_templates,
)
from dynamod.daemon.supervisor.up import resolve_pools as pools_of
from dynamod.shared.errors import ConfigError

AGG = {"agg": PoolBudget(1, 4)}


def _w(index: int, inflight: int | None = 0, started: float | None = None, retiring: bool = False) -> RunningWorker:
    return RunningWorker(f"worker-{index}", "agg", index, float(index if started is None else started), inflight, retiring)


def test_scale_up_takes_the_next_free_indices() -> None:
    plan = plan_scaling({"agg": 4}, {"agg": [_w(0), _w(2)]}, AGG)
    assert plan.add == {"agg": [1, 3]} and plan.remove == [] and plan.targets == {"agg": 4}


def test_a_retiring_worker_is_not_counted_but_keeps_its_index() -> None:
    plan = plan_scaling({"agg": 2}, {"agg": [_w(0), _w(1, retiring=True)]}, AGG)
    assert plan.add == {"agg": [2]}


def test_scale_down_removes_the_least_loaded_then_the_newest() -> None:
    running = {"agg": [_w(0, inflight=3), _w(1, inflight=0, started=5), _w(2, inflight=0, started=9), _w(3, inflight=7)]}
    plan = plan_scaling({"agg": 2}, running, AGG)
    assert [w.name for w in plan.remove] == ["worker-2", "worker-1"]
    assert plan.add == {}


def test_a_worker_not_answering_yet_goes_first() -> None:
    plan = plan_scaling({"agg": 2}, {"agg": [_w(0, inflight=0), _w(1, inflight=1), _w(2, inflight=None, started=0)]}, AGG)
    assert [w.name for w in plan.remove] == ["worker-2"]


def test_desired_is_clamped_to_the_budget_and_unknown_pools_are_ignored() -> None:
    plan = plan_scaling({"agg": 9, "prefill": 2}, {"agg": [_w(0)]}, AGG)
    assert plan.targets == {"agg": 4} and plan.clamped == {"agg": (9, 4)} and plan.ignored == ["prefill"]
    assert plan.add == {"agg": [1, 2, 3]}
    plan = plan_scaling({"agg": 0}, {"agg": [_w(0), _w(1)]}, AGG)
    assert plan.targets == {"agg": 1} and len(plan.remove) == 1  # never below one serving worker


def test_same_count_changes_nothing_and_unmentioned_pools_keep_their_size() -> None:
    budget = {"prefill": PoolBudget(0, 4), "decode": PoolBudget(1, 4)}
    running = {"prefill": [], "decode": [RunningWorker("decode-0", "decode", 0, 0.0, 0)]}
    plan = plan_scaling({"decode": 1}, running, budget)
    assert plan.empty and plan.targets == {"prefill": 0, "decode": 1}


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def test_up_planner_flags() -> None:
    args = _args("--planner", "load", "--min-workers", "1", "--max-workers", "4", "--planner-args", "--adjustment-interval 2")
    resolve_scaling(args)
    assert args.workers == 1  # starts at the minimum
    specs = build_specs(args, "/tmp/kv", "ns")
    assert [s.name for s in specs] == ["frontend", "worker-0", "planner"]
    planner = specs[-1].argv
    for flag, value in (("--role", "planner"), ("--connector", "local"), ("--planner", "load"), ("--mode", "agg"),
                        ("--min-workers", "1"), ("--max-workers", "4"), ("--adjustment-interval", "2"),
                        ("--namespace", "ns"), ("--file-kv", "/tmp/kv")):
        assert planner[planner.index(flag) + 1] == value
    with pytest.raises(ConfigError, match="at least --min-workers"):
        resolve_scaling(_args("--planner", "sla", "--min-workers", "3", "--max-workers", "2"))
    with pytest.raises(ConfigError, match="above --max-workers"):
        resolve_scaling(_args("--planner", "sla", "--workers", "5", "--max-workers", "4"))


def test_added_workers_get_the_flags_of_the_first_ones(tmp_path: Path) -> None:
    args = _args("--prefill-workers", "1", "--decode-workers", "1", "--speedup-ratio", "10", "--decode-args", "--x 1",
                 "--planner", "sla", "--planner-args", "--profile /somewhere/profile.json")
    resolve_scaling(args)
    pools = pools_of(args)
    kv = str(tmp_path / "kv")
    workers = WorkerFactory(args, *runtime_flags(kv, "ns"))
    first = build_specs(args, kv, "ns", workers)
    templates = scaling_templates(pools, workers)
    assert set(templates) == {"prefill", "decode"} and set(scaling_budget(args, pools)) == {"prefill", "decode"}
    added = templates["decode"].spec(3)
    assert added.name == "decode-3" and templates["decode"].index_of("decode-3") == 3
    assert templates["decode"].index_of("prefill-3") is None
    decode0 = next(s for s in first if s.name == "decode-0")

    def without_port_and_name(argv: list[str]) -> list[str]:
        out = list(argv)
        for flag in ("--system-port", "--worker-name"):
            i = out.index(flag)
            del out[i : i + 2]
        return out

    assert without_port_and_name(added.argv) == without_port_and_name(decode0.argv)
    ports = {s.argv[s.argv.index("--system-port") + 1] for s in [*first[1:3], added]}
    assert len(ports) == 3  # never one handed out before
    planner = first[-1].argv
    assert planner.count("--profile") == 1 and "/somewhere/profile.json" in planner  # the operator's, not measured
    assert list(tmp_path.iterdir()) == []


def test_up_sla_planner_plans_from_the_mocker_its_workers_run(tmp_path: Path) -> None:
    """Without ``--profile``, ``up --planner sla`` measures the workers' mocker (speedup, KV size):
    each pool's table with that pool's flags; the shipped profile describes a default mocker."""
    args = _args("--prefill-workers", "1", "--decode-workers", "1", "--speedup-ratio", "0.5",
                 "--num-gpu-blocks", "512", "--block-size", "16", "--prefill-args", "--max-num-seqs 4",
                 "--decode-args", "--max-num-seqs 32", "--planner", "sla")
    resolve_scaling(args)
    kv = tmp_path / "kv"
    planner = build_specs(args, str(kv), "ns")[-1].argv
    path = Path(planner[planner.index("--profile") + 1])
    assert path == tmp_path / "kv-planner-profile.json"
    profile = PerfProfile.load(path)
    assert profile.settings["speedup_ratio"] == 0.5 and profile.settings["num_gpu_blocks"] == 512
    assert profile.settings["max_num_seqs"] == 32 and profile.settings["prefill_settings"]["max_num_seqs"] == 4
    assert profile.decode.max_kv_tokens == 512 * 16
    shipped = PerfProfile.load(default_profile_path())
    # Half the speed: each prefill takes twice the shipped (speedup 1) time.
    assert profile.prefill.ttft(256) == pytest.approx(2 * shipped.prefill.ttft(256), rel=1e-3)
    # The load planner, or another engine, gets no profile.
    for other in (("--planner", "load"), ("--planner", "sla", "--engine", "vllm")):
        argv = build_specs(_args("--workers", "1", *other), str(kv), "ns")[-1].argv
        assert "--profile" not in argv


# -- the supervisor under the scaler --------------------------------------------------------------------


def _sleeper(name: str, marker: Path | None = None) -> ChildSpec:
    """A child that records each start (one line per pid) and sleeps until signalled."""
    code = "import os, sys, time\n"
    if marker is not None:
        code += f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
    code += "time.sleep(600)\n"
    return ChildSpec(name, [sys.executable, "-c", code])


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


async def test_added_child_is_restarted_and_retired_child_is_not(tmp_path: Path) -> None:
    sup = Supervisor([_sleeper("frontend")], tmp_path / "logs", crash_policy=CrashLoopPolicy(max_crashes=0))
    await sup.start()
    try:
        marker = tmp_path / "worker-1.starts"
        child = await sup.add_child(_sleeper("worker-1", marker))
        await _until(lambda: marker.exists() and len(marker.read_text().split()) == 1)
        first_pid = child.pid
        assert first_pid is not None
        os.kill(first_pid, 9)  # a crash: restarted like any child
        await _until(lambda: len(marker.read_text().split()) == 2)
        second_pid = int(marker.read_text().split()[-1])
        assert child.restarts == 1 and child.pid == second_pid
        code = await sup.retire("worker-1", grace_s=5.0)
        assert code == -15  # SIGTERM, not a kill
        assert [c.spec.name for c in sup.children] == ["frontend"]
        assert not _alive(second_pid)
        assert len(marker.read_text().split()) == 2  # never restarted
        assert not sup.gave_up.is_set()
        with pytest.raises(Exception, match="already supervised"):
            await sup.add_child(_sleeper("frontend"))
    finally:
        await sup.stop([["frontend"]], 5.0)


async def test_retire_during_a_restart_backoff_leaves_nothing_running(tmp_path: Path) -> None:
    sup = Supervisor([], tmp_path / "logs", crash_policy=CrashLoopPolicy(max_crashes=0))
    await sup.start()
    try:
        marker = tmp_path / "w.starts"
        child = await sup.add_child(_sleeper("worker-0", marker))
        await _until(lambda: marker.exists())
        pid = child.pid
        assert pid is not None
        os.kill(pid, 9)
        await _until(lambda: child.proc is not None and child.proc.returncode is not None)
        code = await sup.retire("worker-0", grace_s=5.0)  # lands in the backoff before the restart
        assert code == -9
        assert sup.children == []
        assert len(marker.read_text().split()) == 1  # the restart never happened
    finally:
        await sup.stop([], 5.0)
