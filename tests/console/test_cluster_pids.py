"""Process-mode ``dynamoctl cluster`` commands, run for real by ``sh``: a pid file whose pid now
belongs to another process (the kernel reused the number) is not ours, so ``down`` never signals
that process's group, ``status`` says stopped and ``up`` starts the role again."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamod.console.ctl.cluster import commands as cmds
from dynamod.console.ctl.cluster.inventory import Inventory, RoleSpec, parse_inventory
from tests.fixtures.servers import wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")


def _inventory(workdir: Path) -> tuple[Inventory, RoleSpec]:
    inv = parse_inventory({
        "cluster": {"discovery": "file", "dynamod": "dynamod-stand-in", "workdir": str(workdir)},
        "hosts": [{"address": "127.0.0.1", "roles": [{"role": "up", "name": "svc", "args": []}]}],
    })
    return inv, inv.hosts[0].roles[0]


def _sh(script: str) -> str:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process leading its own process group, as a reused pid's new owner would."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _record(workdir: Path, pid: int, started: str | None) -> None:
    run = workdir / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "svc.pid").write_text(f"{pid}\n")
    (run / "svc.mode").write_text(cmds.MODE_PROCESS)
    if started is not None:
        (run / "svc.started").write_text(f"{started}\n")


@pytest.mark.parametrize("started", ["1", None], ids=["other-start-time", "no-start-time"])
def test_down_and_status_leave_a_reused_pid_alone(tmp_path: Path, stranger: subprocess.Popen[bytes], started: str | None) -> None:
    inv, role = _inventory(tmp_path)
    _record(tmp_path, stranger.pid, started)
    assert _sh(cmds.status_command(inv.cluster, role, cmds.MODE_PROCESS)) == "stopped 0"
    assert _sh(cmds.stop_command(inv.cluster, role, cmds.MODE_PROCESS)) == "not running"
    assert stranger.poll() is None, "cluster down signalled a process it did not start"
    assert not (tmp_path / "run" / "svc.pid").exists()  # the stale record is gone


def test_up_over_a_reused_pid_starts_the_role_and_down_stops_only_it(tmp_path: Path, stranger: subprocess.Popen[bytes]) -> None:
    inv, role = _inventory(tmp_path)
    _record(tmp_path, stranger.pid, "1")
    script = cmds.start_command(inv.cluster, role, cmds.MODE_PROCESS).replace(
        shlex.join(["dynamod-stand-in", "up"]), "sleep 300"
    )
    out = _sh(script)
    assert out.startswith("started "), out
    pgid = int((tmp_path / "run" / "svc.pid").read_text())
    assert pgid != stranger.pid
    # What was recorded is the new leader's own start time.
    assert (tmp_path / "run" / "svc.started").read_text().strip() == _start_time(pgid)
    wait_until(lambda: (tmp_path / "run" / "svc.child").read_text().strip(), 10, what="the role's child")
    assert _sh(cmds.status_command(inv.cluster, role, cmds.MODE_PROCESS)).split()[0] == "running"
    assert _sh(script).startswith("already running")
    assert _sh(cmds.stop_command(inv.cluster, role, cmds.MODE_PROCESS)) == "stopped"
    assert subprocess.run(["kill", "-0", "--", f"-{pgid}"], capture_output=True).returncode != 0
    assert stranger.poll() is None
