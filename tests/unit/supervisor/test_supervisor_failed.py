"""The supervisor gives up on a crash-looping pool worker alone while its pool has others, restarts it
on request, and stops everything only when a pool's last worker goes (issue 24 item 6). Real child
processes (tiny Python one-liners), no cluster."""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path

import pytest

from dynamod.daemon.supervisor.children import ChildSpec, CrashLoopPolicy, Supervisor
from dynamod.shared.errors import DynamoError

pytestmark = pytest.mark.timeout(60)

CRASH = [sys.executable, "-c", "import sys; print('boom', flush=True); sys.exit(1)"]
SERVE = [sys.executable, "-c", "import time; time.sleep(60)"]


def _spec(name: str, argv: list[str], pool: str | None = "agg") -> ChildSpec:
    spec = ChildSpec(name, argv)
    spec.pool = pool
    return spec


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_crash_looping_worker_is_given_up_on_alone_and_restarted_on_request(tmp_path: Path) -> None:
    changes: list[list[str]] = []
    report = io.StringIO()
    sup = Supervisor([_spec("worker-0", SERVE), _spec("worker-1", CRASH)], tmp_path, report=report,
                     crash_policy=CrashLoopPolicy(max_crashes=2, window_s=60))
    sup.on_change = lambda: changes.append([c.spec.name for c in sup.failed])
    await sup.start()
    try:
        await _until(lambda: bool(sup.failed))
        assert [c.spec.name for c in sup.failed] == ["worker-1"] and changes == [["worker-1"]]
        assert not sup.gave_up.is_set() and sup.crash_loop is None
        assert sup.child("worker-0").pid is not None
        assert "`dynamoctl restart worker-1` tries it again" in report.getvalue()
        with pytest.raises(DynamoError, match="worker-0 is not failed"):
            await sup.restart("worker-0")
        await sup.restart("worker-1")  # a fresh count: it crashes twice more before it is failed again
        assert changes[-1] == [] and sup.child("worker-1").failed is None
        await _until(lambda: bool(sup.failed))
        assert report.getvalue().count("not restarting it (crash loop)") == 2
    finally:
        await sup.stop([], grace_s=5)


async def test_the_last_worker_of_a_pool_or_a_child_without_one_stops_everything(tmp_path: Path) -> None:
    sup = Supervisor([_spec("worker-0", CRASH), _spec("worker-1", CRASH), _spec("frontend", SERVE, pool=None)],
                     tmp_path, report=io.StringIO(), crash_policy=CrashLoopPolicy(max_crashes=2, window_s=60))
    await sup.start()
    try:
        await asyncio.wait_for(sup.gave_up.wait(), 20)
        assert sup.crash_loop is not None and len(sup.failed) == 1  # one given up alone, then the last one stopped all
        assert {sup.crash_loop.child, sup.failed[0].spec.name} == {"worker-0", "worker-1"}
    finally:
        await sup.stop([], grace_s=5)
    lone = Supervisor([_spec("planner", CRASH, pool=None), _spec("worker-0", SERVE)], tmp_path / "2",
                      report=io.StringIO(), crash_policy=CrashLoopPolicy(max_crashes=2, window_s=60))
    await lone.start()
    try:
        await asyncio.wait_for(lone.gave_up.wait(), 20)
        assert lone.crash_loop is not None and lone.crash_loop.child == "planner" and lone.failed == []
    finally:
        await lone.stop([], grace_s=5)
