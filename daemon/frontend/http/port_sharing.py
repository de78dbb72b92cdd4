"""Extra frontend processes on the same port (``--num-frontends N``).

The first process binds the port (resolving port 0) and starts N-1 copies of itself with the same
flags and that port; the kernel spreads new connections over all of them (``SO_REUSEPORT``). A copy
that dies is started again after a short backoff, never while shutting down. Copies die with their
parent (``PR_SET_PDEATHSIG``) so a killed parent leaves no orphan holding the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

_STRIPPED_FLAGS = ("--num-frontends", "--http-port", "--frontend-group-pid")
_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the parent dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_argv(argv: list[str], port: int, parent_pid: int) -> list[str]:
    """This process's flags with the port fixed and the fleet size reset to one."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _STRIPPED_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return [*out, "--num-frontends", "1", "--http-port", str(port), "--frontend-group-pid", str(parent_pid)]


class FrontendFleet:
    def __init__(self, count: int, port: int, argv: list[str] | None = None) -> None:
        self._count = count
        self._port = port
        self._argv = list(sys.argv[1:] if argv is None else argv)
        self._procs: list[asyncio.subprocess.Process | None] = [None] * count
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.on_change: Callable[[list[int]], None] | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None and p.returncode is None]

    async def start(self) -> None:
        for index in range(self._count):
            await self._spawn(index)
        self._tasks = [asyncio.create_task(self._keep(index), name=f"frontend-copy-{index}") for index in range(self._count)]

    async def _spawn(self, index: int) -> None:
        cmd = [sys.executable, "-m", "dynamod.daemon.cli", *child_argv(self._argv, self._port, os.getpid())]
        proc = await asyncio.create_subprocess_exec(*cmd, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self._procs[index] = proc
        logger.info("frontend copy started index=%d pid=%d port=%d", index, proc.pid, self._port)
        if self.on_change is not None:
            self.on_change(self.pids)

    async def _keep(self, index: int) -> None:
        failures = 0
        while True:
            proc = self._procs[index]
            assert proc is not None
            code = await proc.wait()
            if self._stopping:
                return
            delay = _RESTART_BACKOFF_S[min(failures, len(_RESTART_BACKOFF_S) - 1)]
            failures += 1
            logger.warning("frontend copy exited index=%d pid=%d code=%s action=restart_in_%.1fs", index, proc.pid, code, delay)
            await asyncio.sleep(delay)
            if self._stopping:
                return
            await self._spawn(index)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every copy (they drain like this process), then SIGKILL after ``grace_s``."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        live = [p for p in self._procs if p is not None and p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if not live:
            return
        done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=max(grace_s, 0.1))
        for proc in live:
            if proc.returncode is None:
                logger.warning("frontend copy did not stop pid=%d action=kill", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for fut in pending:
            with contextlib.suppress(asyncio.CancelledError, ProcessLookupError):
                await fut
