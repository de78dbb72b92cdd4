"""Supervised child processes: start, watch, restart, stop.

Each child is a real ``dynamod`` process in its own session (so a terminal's Ctrl-C reaches only
the supervisor, which then stops children in order) that dies with its parent
(``PR_SET_PDEATHSIG``). A child is judged alive by its exit status and, when it has an HTTP
liveness URL, by that URL answering: a child that stops answering for ``hang_after_s`` is killed
and replaced. Restarts back off exponentially and never happen while the supervisor is stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
_STABLE_AFTER_S = 30.0  # a child that ran this long resets its backoff
_PROBE_INTERVAL_S = 2.0


def _child_setup() -> None:
    """Runs in the child before exec: die with the supervisor (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    live_url: str | None = None  # GET must answer 200 while the child is healthy
    hang_after_s: float = 30.0
    env: dict[str, str] | None = None


@dataclass(eq=False)
class Child:
    spec: ChildSpec
    log_path: Path | None
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None


def _probe(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Supervisor:
    def __init__(self, specs: list[ChildSpec], log_dir: Path | None) -> None:
        self.children = [Child(spec, (log_dir / f"{spec.name}.log") if log_dir else None) for spec in specs]
        self._log_dir = log_dir
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        if self._log_dir is not None:
            await asyncio.to_thread(self._log_dir.mkdir, parents=True, exist_ok=True)
        for child in self.children:
            await self._spawn(child)
        self._tasks = [asyncio.create_task(self._watch(c), name=f"supervise-{c.spec.name}") for c in self.children]

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.spec.name == name:
                return c
        raise KeyError(name)

    async def _spawn(self, child: Child) -> None:
        if child.log_path is not None:
            if child._log is None:
                # Kept open for the child's life; reopened never, so restarts append to one file.
                child._log = await asyncio.to_thread(open, child.log_path, "ab")
            out: IO[bytes] | int | None = child._log
        else:
            out = None
        child.proc = await asyncio.create_subprocess_exec(
            *child.spec.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=child.spec.env,
            start_new_session=True,
            preexec_fn=_child_setup,  # noqa: PLW1509
        )
        child.started_at = time.monotonic()
        logger.info("child started name=%s pid=%d restarts=%d", child.spec.name, child.proc.pid, child.restarts)

    async def _watch(self, child: Child) -> None:
        failures = 0
        while not self._stopping:
            proc = child.proc
            assert proc is not None
            reason = await self._until_dead(child, proc)
            if self._stopping:
                return
            ran_s = time.monotonic() - child.started_at
            if ran_s >= _STABLE_AFTER_S:
                failures = 0
            delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
            failures += 1
            logger.warning(
                "child died name=%s pid=%d reason=%s ran_s=%.1f action=restart_in_%.1fs",
                child.spec.name, proc.pid, reason, ran_s, delay,
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            child.restarts += 1
            await self._spawn(child)

    async def _until_dead(self, child: Child, proc: asyncio.subprocess.Process) -> str:
        """Returns why the child is gone: its exit, or a liveness URL that stopped answering."""
        url = child.spec.live_url
        if url is None:
            return f"exit code {await proc.wait()}"
        wait = asyncio.ensure_future(proc.wait())
        last_ok = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait([wait], timeout=_PROBE_INTERVAL_S)
                if done:
                    return f"exit code {wait.result()}"
                if await asyncio.to_thread(_probe, url):
                    last_ok = time.monotonic()
                elif time.monotonic() - last_ok > child.spec.hang_after_s:
                    logger.warning("child not answering name=%s pid=%d url=%s action=kill", child.spec.name, proc.pid, url)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await wait
                    return f"hung (no answer from {url} for {child.spec.hang_after_s:.0f}s)"
        finally:
            if not wait.done():
                wait.cancel()

    async def stop(self, order: list[list[str]], grace_s: float) -> None:
        """Stops children group by group (names in ``order``): SIGTERM, wait, SIGKILL stragglers."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        named = {c.spec.name: c for c in self.children}
        groups = [[named[n] for n in group if n in named] for group in order]
        listed = {id(c) for group in groups for c in group}
        groups.append([c for c in self.children if id(c) not in listed])
        for group in groups:
            await self._stop_group(group, grace_s)
        for child in self.children:
            if child._log is not None:
                child._log.close()
                child._log = None

    async def _stop_group(self, group: list[Child], grace_s: float) -> None:
        live = [c for c in group if c.proc is not None and c.proc.returncode is None]
        for child in live:
            assert child.proc is not None
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
        if not live:
            return
        waits = {asyncio.ensure_future(c.proc.wait()): c for c in live if c.proc is not None}
        _, pending = await asyncio.wait(list(waits), timeout=grace_s)
        for fut in pending:
            child = waits[fut]
            assert child.proc is not None
            logger.warning("child did not stop in time name=%s pid=%d action=kill", child.spec.name, child.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
            await fut
        for child in live:
            assert child.proc is not None
            logger.info("child stopped name=%s pid=%d code=%s", child.spec.name, child.proc.pid, child.proc.returncode)
