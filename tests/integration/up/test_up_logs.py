"""Children's logs of ``dynamod up`` rotate by size without losing or splitting a line; a crash report
still shows the current run's last lines after a rotation; a full disk does not block a child.

The supervisor's tests run real child processes (small Python programs that print numbered lines
and exit); the last one runs ``dynamod up`` itself with a tiny ``--log-max-bytes``."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamod.daemon.supervisor.children import ChildSpec, CrashLoopPolicy, Supervisor
from dynamod.daemon.supervisor.logfile import RotatingLog, parse_size
from tests.fixtures.daemons import Up, up_command
from tests.fixtures.disk import tiny_tmpfs
from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import clean_env

pytestmark = pytest.mark.timeout(120)

LINE = "line {:06d} " + "x" * 80  # ~93 bytes with the newline


def printer(first: int, count: int, code: int, *, then_sleep: float = 0.0) -> ChildSpec:
    """A child that prints lines ``first``..``first+count-1`` (stdout and stderr mixed) and exits."""
    script = (
        "import sys, time\n"
        f"for i in range({first}, {first + count}):\n"
        f"    print({LINE!r}.format(i), file=sys.stderr if i % 7 == 0 else sys.stdout, flush=True)\n"
        f"time.sleep({then_sleep})\n"
        f"sys.exit({code})\n"
    )
    return ChildSpec("chatty", [sys.executable, "-c", script])


def log_files(log_dir: Path, name: str = "chatty") -> list[Path]:
    """Oldest first: name.log.N ... name.log.1, name.log."""
    rotated = sorted(log_dir.glob(f"{name}.log.*"), key=lambda p: int(p.suffix[1:]), reverse=True)
    return [*rotated, log_dir / f"{name}.log"]


def numbers(paths: list[Path]) -> list[int]:
    out = []
    for path in paths:
        text = path.read_text()
        assert text == "" or text.endswith("\n"), f"{path} ends mid-line"
        for line in text.splitlines():
            head, num, rest = line.split(" ", 2)
            assert head == "line" and rest == "x" * 80, f"split or mangled line in {path}: {line!r}"
            out.append(int(num))
    return out


async def supervise_until_reports(sup: Supervisor, report: io.StringIO, reports: int, timeout_s: float = 30) -> None:
    await sup.start()
    try:
        deadline = time.monotonic() + timeout_s
        for _ in iter(int, 1):  # poll with a deadline: the report is a plain StringIO
            if report.getvalue().count(" died (") >= reports or sup.gave_up.is_set():
                break
            assert time.monotonic() < deadline, f"no {reports} death report(s) in {timeout_s}s: {report.getvalue()}"
            await asyncio.sleep(0.02)
    finally:
        await sup.stop([], grace_s=5)


# -- the rotating file ------------------------------------------------------------------------


def test_sizes_parse_in_binary_units() -> None:
    assert parse_size("50M") == parse_size("50MiB") == 50 * 2**20
    assert parse_size("512k") == 512 * 1024 and parse_size("1G") == 2**30 and parse_size("1234") == 1234
    assert parse_size("0") == 0
    with pytest.raises(ValueError):
        parse_size("lots")


def test_rotation_keeps_backups_at_line_boundaries(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "chatty.log", max_bytes=1000, backups=2)
    data = "".join(LINE.format(i) + "\n" for i in range(100)).encode()
    for start in range(0, len(data), 37):  # chunks that cut lines anywhere, as a pipe read does
        log.write(data[start : start + 37])
    log.close()
    files = log_files(tmp_path)
    assert [p.name for p in files] == ["chatty.log.2", "chatty.log.1", "chatty.log"]
    assert all(p.stat().st_size <= 1000 + 93 for p in files)  # at most one line over, to end it
    got = numbers(files)
    assert got == list(range(got[0], 100)), "lines lost or reordered across rotations"
    assert log.rotations >= 9


def test_no_backups_means_the_log_starts_over(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "chatty.log", max_bytes=500, backups=0)
    for i in range(20):
        log.write((LINE.format(i) + "\n").encode())
    log.close()
    assert log_files(tmp_path) == [tmp_path / "chatty.log"]
    got = numbers([tmp_path / "chatty.log"])
    assert got == list(range(got[0], 20)) and len(got) <= 6


def test_zero_max_bytes_never_rotates(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "chatty.log", max_bytes=0, backups=3)
    for i in range(200):
        log.write((LINE.format(i) + "\n").encode())
    log.close()
    assert numbers(log_files(tmp_path)) == list(range(200))


# -- the supervisor with real children ----------------------------------------------------------


async def test_a_chatty_child_rotates_and_its_crash_report_shows_the_runs_end(tmp_path: Path) -> None:
    report = io.StringIO()
    sup = Supervisor([printer(0, 3000, 3)], tmp_path, report=report, log_max_bytes=20_000, log_backups=2,
                     crash_policy=CrashLoopPolicy(max_crashes=1))
    await supervise_until_reports(sup, report, 1)
    files = log_files(tmp_path)
    assert [p.name for p in files] == ["chatty.log.2", "chatty.log.1", "chatty.log"]
    assert all(p.stat().st_size <= 20_000 + 93 for p in files)
    got = numbers(files)
    assert got == list(range(got[0], 3000)), "lines lost across rotations"
    # The report's tail is this run's last 20 lines, though the file it started in was rotated away.
    text = report.getvalue()
    assert "chatty died (exit code 3)" in text
    shown = [line.removeprefix("  | ") for line in text.splitlines() if line.startswith("  | ")]
    assert shown == [LINE.format(i) for i in range(2980, 3000)]


async def test_after_a_restart_the_report_shows_only_the_new_run(tmp_path: Path) -> None:
    """Run 1 prints 0..499 and exits 1; run 2 prints 10000..10004 and exits 2: the second report has
    only run 2's five lines, and the file (rotated meanwhile) holds both runs in order."""
    report = io.StringIO()
    script_runs = tmp_path / "runs"
    script = (
        "import os, sys\n"
        f"p = {str(script_runs)!r}\n"
        "n = int(open(p).read()) if os.path.exists(p) else 0\n"
        "open(p, 'w').write(str(n + 1))\n"
        "first, count = (0, 500) if n == 0 else (10000, 5)\n"
        "for i in range(first, first + count):\n"
        f"    print({LINE!r}.format(i), flush=True)\n"
        "sys.exit(n + 1)\n"
    )
    logs = tmp_path / "logs"
    sup = Supervisor([ChildSpec("chatty", [sys.executable, "-c", script])], logs, report=report,
                     log_max_bytes=20_000, log_backups=5, crash_policy=CrashLoopPolicy(max_crashes=2))
    await supervise_until_reports(sup, report, 2)
    text = report.getvalue()
    second = text[text.index("chatty died (exit code 2)"):]
    shown = [line.removeprefix("  | ") for line in second.splitlines() if line.startswith("  | ")]
    assert shown == [LINE.format(i) for i in range(10000, 10005)]
    assert numbers(log_files(logs)) == [*range(500), *range(10000, 10005)]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_a_full_disk_drops_output_but_never_blocks_the_child(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """~280 KB of output into a 64 KiB file system: the child still runs to its end (a pipe nobody
    drained would block it after 64 KiB), the supervisor says once that the disk is full, and the
    crash report still shows the run's last lines (kept in memory)."""
    caplog.set_level(logging.INFO, logger="dynamod.daemon.supervisor.logfile")
    logs = tmp_path / "logs"
    with tiny_tmpfs(logs):
        report = io.StringIO()
        sup = Supervisor([printer(0, 3000, 4)], logs, report=report, log_max_bytes=0,
                         crash_policy=CrashLoopPolicy(max_crashes=1))
        await supervise_until_reports(sup, report, 1)
        text = report.getvalue()
        assert "chatty died (exit code 4)" in text
        shown = [line.removeprefix("  | ") for line in text.splitlines() if line.startswith("  | ")]
        assert shown == [LINE.format(i) for i in range(2980, 3000)]
        failing = [r for r in caplog.records if "child log write failing" in r.getMessage()]
        assert len(failing) == 1 and "disk_full" in failing[0].getMessage()


# -- dynamod up ---------------------------------------------------------------------------------


def test_up_help_documents_the_rotation_flags() -> None:
    out = " ".join(subprocess.run(up_command("--help"), capture_output=True, text=True, check=True).stdout.split())
    assert "--log-max-bytes SIZE" in out and "--log-backups" in out
    assert "[default 50M]" in out and "[default 3]" in out


def test_up_rotates_its_childrens_logs_and_reports_a_killed_worker(tmp_path: Path) -> None:
    port = free_port()
    file_kv = tmp_path / "discovery"
    logs = tmp_path / "logs"
    env = clean_env(file_kv)
    up = Up(up_command("--http-port", str(port), "--workers", "1", "--speedup-ratio", "10", "--file-kv",
                        str(file_kv), "--log-dir", str(logs), "--log-max-bytes", "1K", "--log-backups", "2"),
            env, cwd=tmp_path)
    try:
        up.wait_up()
        wait_until(lambda: (logs / "worker-0.log.1").exists(), 30, what="a rotated worker log")
        for name in ("worker-0", "frontend"):
            files = sorted(logs.glob(f"{name}.log*"))
            assert len(files) <= 3, files  # name.log + 2 backups
        pid = int(wait_until(lambda: _child_pid(up.output, "worker-0"), 10, what="the worker's pid"))
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "worker-0 died (killed by SIGKILL)" in up.output, 30, what="the crash report")
        wait_until(lambda: "  | " in up.output.split("worker-0 died (killed by SIGKILL)")[-1], 10, what="its log's tail")
        assert "line(s) of" in up.output.split("worker-0 died (killed by SIGKILL)")[-1]
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
        for path in logs.glob("*.log*"):
            assert path.stat().st_size <= 1024 + 2048, path  # the limit, plus at most the line that ended it
            assert path.read_bytes().endswith(b"\n"), path
    finally:
        up.kill()


def _child_pid(output: str, name: str) -> int | None:
    found = None
    for line in output.splitlines():
        if f"child started name={name} pid=" in line:
            found = int(line.split(f"name={name} pid=")[1].split()[0])
    return found
