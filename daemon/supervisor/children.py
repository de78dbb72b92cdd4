"""Supervised child processes: start, watch, restart, stop.

Each child is a real ``dynamod`` process in its own session (so a terminal's Ctrl-C reaches only
the supervisor, which then stops children in order) that dies with its parent
(``PR_SET_PDEATHSIG``). A child is judged alive by its exit status and, when it has an HTTP
liveness URL, by that URL answering: a child that stops answering for ``hang_after_s`` is killed
and replaced. Restarts back off exponentially and never happen while the supervisor is stopping.

When a child dies, the supervisor reports why (exit code or signal) with the last lines the child
wrote to its log in that run, so an import error or a bad flag is on the operator's terminal and not
only in a file. A child's output reaches its log through a pipe the supervisor reads
(``logfile.py``: the log rotates by size without losing lines, and the run's last lines are kept in
memory for that report). A child that keeps dying (``CrashLoopPolicy``: 5 deaths within 60 s by default) is
not restarted again. If it is a pool worker (``ChildSpec.pool``) and another worker of its pool is
still supervised, only it is given up on (``Child.failed``; ``restart`` starts it again on request)
and the pool serves on; otherwise the supervisor records a ``CrashLoop`` and sets ``gave_up``, and
its owner stops the rest and exits with one message naming the child and its log. A child that
exits with status 2 (argparse's usage error: a bad flag, the same on every restart) is a
``CrashLoop`` at once, with the child's own error line.

Children can come and go while the supervisor runs (the planner's scaler, ``scaler.py``):
``add_child`` starts one under the same restart and crash-loop rules as the first ones, and
``retire`` stops one for good. Retirement goes through the child's own watch task, which is the
only code that spawns its processes: a retire that lands while a crashed child is being restarted
then stops the new process too, instead of leaving it running unwatched.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from dynamod.daemon.supervisor.logfile import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, LogPump, RotatingLog
from dynamod.shared.errors import DynamoError

logger = logging.getLogger(__name__)

_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
_STABLE_AFTER_S = 30.0  # a child that ran this long resets its backoff
_PROBE_INTERVAL_S = 2.0
LOG_TAIL_LINES = 20
_DRAIN_WAIT_S = 2.0  # how long a crash report waits for the dead child's last output
USAGE_EXIT_CODE = 2  # argparse's exit status: a bad flag, which no restart fixes


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
    live_ssl: ssl.SSLContext | None = None  # for an https:// live_url (probe.py: the child's own certificate)
    hang_after_s: float = 30.0
    env: dict[str, str] | None = None
    # Workers of one pool (agg, prefill, decode): a crash loop gives up on this child alone while
    # another child of its pool is still supervised, instead of stopping everything.
    pool: str | None = None


@dataclass(frozen=True)
class CrashLoopPolicy:
    """A child that dies ``max_crashes`` times within ``window_s`` is not restarted again (0: never
    give up). Hang kills count too; a hang takes ``hang_after_s`` to detect, so they rarely add up."""

    max_crashes: int = 5
    window_s: float = 60.0


@dataclass(frozen=True)
class CrashLoop:
    """Why the supervisor gave up on a child."""

    child: str
    crashes: int
    window_s: float
    last_reason: str
    log_path: Path | None
    usage_error: str | None = None  # the child's own error line when it exited with status 2

    def message(self) -> str:
        where = f"its log: {self.log_path}" if self.log_path is not None else "its output is above"
        if self.usage_error is not None:
            return (
                f"{self.child} refused its flags (exit code {USAGE_EXIT_CODE}): {self.usage_error}; "
                f"the same flags would fail again, so the cluster is stopped. See {where}"
            )
        return (
            f"{self.child} died {self.crashes} times within {self.window_s:g}s (last: {self.last_reason}); "
            f"not restarting it, so the cluster is stopped. See {where}"
        )


class CrashLoopError(DynamoError):
    code = "crash_loop"


@dataclass(eq=False)
class Child:
    spec: ChildSpec
    log_path: Path | None
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    _log: RotatingLog | None = field(default=None, repr=False)
    _pump: LogPump | None = field(default=None, repr=False)  # the current run's output reader
    _old_pumps: list[LogPump] = field(default_factory=list, repr=False)
    retiring: bool = False  # being stopped for good: its deaths are not crashes, it is not restarted
    failed: CrashLoop | None = None  # given up on alone (its pool serves on); ``Supervisor.restart`` retries
    _retire: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _retire_grace_s: float = 30.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None


def exit_reason(returncode: int) -> str:
    """``exit code 2``, or ``killed by SIGKILL`` for a negative (signal) return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _error_line(tail: list[str]) -> str:
    """The line of a dead child's output that says what was wrong (argparse's ``...: error: ...``),
    else its last line."""
    for line in reversed(tail):
        if ": error: " in line:
            return line.strip()
    return tail[-1].strip() if tail else "(its output is above)"


def _probe(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Supervisor:
    """Starts ``specs``, restarts them when they die, gives up on one in a crash loop.

    ``report`` receives the crash reports (the reason and the log's last lines), a stream for
    people: the event itself is also logged, on one line.
    """

    def __init__(
        self,
        specs: list[ChildSpec],
        log_dir: Path | None,
        *,
        crash_policy: CrashLoopPolicy | None = None,
        report: TextIO | None = None,
        prog: str = "dynamod up",
        log_max_bytes: int = DEFAULT_MAX_BYTES,
        log_backups: int = DEFAULT_BACKUPS,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.children = [Child(spec, (log_dir / f"{spec.name}.log") if log_dir else None) for spec in specs]
        self._log_dir = log_dir
        self._log_max_bytes = log_max_bytes
        self._log_backups = log_backups
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self._policy = crash_policy or CrashLoopPolicy()
        self._report_to = report
        self._prog = prog
        self.gave_up = asyncio.Event()
        self.crash_loop: CrashLoop | None = None
        self.on_change = on_change  # called when a child is given up on alone or restarted by request

    def _pool_serves_without(self, child: Child) -> bool:
        """True when ``child`` is a pool worker and another worker of its pool is supervised
        (not given up on, not being retired): the pool serves on without it."""
        pool = child.spec.pool
        return pool is not None and any(
            c is not child and c.spec.pool == pool and c.failed is None and not c.retiring for c in self.children
        )

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a listener's bug must not stop the supervision
                logger.exception("supervisor change listener failed")

    @property
    def failed(self) -> list[Child]:
        """The children given up on alone, whose pools serve on without them."""
        return [c for c in self.children if c.failed is not None]

    async def restart(self, name: str) -> Child:
        """Starts a child given up on (``failed``) again, with a fresh crash count: the operator
        fixed what made it crash, or wants to see it fail once more."""
        if self._stopping:
            raise DynamoError(f"cannot restart {name}: the supervisor is stopping")
        child = self.child(name)
        if child.failed is None:
            raise DynamoError(f"{name} is not failed: it is supervised and restarted when it dies")
        child.failed = None
        child.restarts += 1
        await self._spawn(child)
        self._tasks[name] = asyncio.create_task(self._watch(child), name=f"supervise-{name}")
        logger.info("child restarted by request name=%s pid=%s", name, child.pid)
        self._changed()
        return child

    async def start(self) -> None:
        if self._log_dir is not None:
            await asyncio.to_thread(self._log_dir.mkdir, parents=True, exist_ok=True)
        for child in self.children:
            await self._spawn(child)
        for child in self.children:
            self._tasks[child.spec.name] = asyncio.create_task(self._watch(child), name=f"supervise-{child.spec.name}")

    async def add_child(self, spec: ChildSpec) -> Child:
        """Starts one more child, supervised like the others (restarts, crash loop, log file)."""
        if self._stopping:
            raise DynamoError(f"cannot start {spec.name}: the supervisor is stopping")
        if any(c.spec.name == spec.name for c in self.children):
            raise DynamoError(f"a child named {spec.name!r} is already supervised")
        child = Child(spec, (self._log_dir / f"{spec.name}.log") if self._log_dir else None)
        self.children.append(child)
        try:
            await self._spawn(child)
        except BaseException:
            self.children.remove(child)
            raise
        self._tasks[spec.name] = asyncio.create_task(self._watch(child), name=f"supervise-{spec.name}")
        return child

    async def retire(self, name: str, grace_s: float) -> int | None:
        """Stops child ``name`` for good (SIGTERM, then SIGKILL after ``grace_s``) and forgets it:
        it is not restarted and its death is no crash. Returns its exit code (None if it was not
        running). The caller drains it first; SIGTERM's own graceful path is the second net."""
        child = self.child(name)
        task = self._tasks.get(name)
        child.retiring = True
        child._retire_grace_s = grace_s
        child._retire.set()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        code = child.proc.returncode if child.proc is not None else None
        pumps = [p for p in (*child._old_pumps, child._pump) if p is not None]
        await asyncio.to_thread(lambda: [p.join(_DRAIN_WAIT_S) for p in pumps])
        child._pump, child._old_pumps = None, []
        if child._log is not None:
            child._log.close()
            child._log = None
        if child in self.children:
            self.children.remove(child)
        self._tasks.pop(name, None)
        logger.info("child retired name=%s code=%s", name, code)
        return code

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.spec.name == name:
                return c
        raise KeyError(name)

    async def _spawn(self, child: Child) -> None:
        if child.log_path is None:  # --log-to-console: the child inherits the terminal
            child.proc = await self._exec(child, None)
        else:
            if child._log is None:
                # One per child for the supervisor's life: restarts append to the same (rotating) file.
                child._log = await asyncio.to_thread(
                    RotatingLog, child.log_path, self._log_max_bytes, self._log_backups
                )
            read_fd, write_fd = os.pipe()
            try:
                child.proc = await self._exec(child, write_fd)
            except BaseException:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)  # the child holds its copy; EOF comes when it (and its heirs) exit
            if child._pump is not None:
                child._old_pumps = [p for p in child._old_pumps if not p.join(0)] + [child._pump]
            child._pump = LogPump(read_fd, child._log, child.spec.name, LOG_TAIL_LINES)
        child.started_at = time.monotonic()
        logger.info("child started name=%s pid=%d restarts=%d", child.spec.name, child.proc.pid, child.restarts)

    async def _exec(self, child: Child, out: int | None) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *child.spec.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=child.spec.env,
            start_new_session=True,
            preexec_fn=_child_setup,  # noqa: PLW1509
        )

    async def _watch(self, child: Child) -> None:
        failures = 0
        deaths: deque[float] = deque()
        last_tail: list[str] | None = None
        policy = self._policy
        while not self._stopping:
            proc = child.proc
            assert proc is not None
            reason = await self._until_dead_or_retired(child, proc)
            if self._stopping:
                return
            if reason is None:
                await self._terminate(child, proc, child._retire_grace_s)
                return
            now = time.monotonic()
            ran_s = now - child.started_at
            deaths.append(now)
            while deaths and now - deaths[0] > policy.window_s:
                deaths.popleft()
            tail = await self._log_tail(child)
            if proc.returncode == USAGE_EXIT_CODE:
                # A usage error is the same on every restart: stop at once, with the child's words.
                self.crash_loop = CrashLoop(
                    child.spec.name, len(deaths), policy.window_s, reason, child.log_path, usage_error=_error_line(tail)
                )
                logger.error("child usage error name=%s pid=%d action=give_up log=%s", child.spec.name, proc.pid,
                             child.log_path)
                self._report(child, reason, ran_s, "not restarting it (a usage error)", tail, repeated=False)
                self.gave_up.set()
                return
            if policy.max_crashes and len(deaths) >= policy.max_crashes:
                loop = CrashLoop(child.spec.name, len(deaths), policy.window_s, reason, child.log_path)
                if self._pool_serves_without(child):
                    child.failed = loop
                    logger.error(
                        "child crash loop name=%s pid=%d reason=%s deaths=%d window_s=%g action=give_up_alone "
                        "pool=%s log=%s", child.spec.name, proc.pid, reason, len(deaths), policy.window_s,
                        child.spec.pool, child.log_path,
                    )
                    self._report(child, reason, ran_s, f"not restarting it (crash loop); the other {child.spec.pool} "
                                 f"workers serve on. `dynamoctl restart {child.spec.name}` tries it again", tail,
                                 repeated=False)
                    self._changed()
                    return
                self.crash_loop = loop
                logger.error(
                    "child crash loop name=%s pid=%d reason=%s deaths=%d window_s=%g action=give_up log=%s",
                    child.spec.name, proc.pid, reason, len(deaths), policy.window_s, child.log_path,
                )
                self._report(child, reason, ran_s, "not restarting it (crash loop)", tail, repeated=False)
                self.gave_up.set()
                return
            if ran_s >= _STABLE_AFTER_S:
                failures = 0
            delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
            failures += 1
            logger.warning(
                "child died name=%s pid=%d reason=%s ran_s=%.1f action=restart_in_%.1fs",
                child.spec.name, proc.pid, reason, ran_s, delay,
            )
            self._report(child, reason, ran_s, f"restarting it in {delay:g}s", tail, repeated=tail == last_tail)
            last_tail = tail
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child._retire.wait(), delay)
            if self._stopping or child.retiring:
                return
            child.restarts += 1
            await self._spawn(child)

    async def _log_tail(self, child: Child) -> list[str]:
        """The dead run's last lines, once its output is drained (or after ``_DRAIN_WAIT_S`` if a
        process it started still holds the pipe)."""
        pump = child._pump
        if pump is None:
            return []  # its output went to the terminal already
        await asyncio.to_thread(pump.join, _DRAIN_WAIT_S)
        return pump.tail()

    def _report(self, child: Child, reason: str, ran_s: float, action: str, tail: list[str], *, repeated: bool) -> None:
        """The death on the terminal, with the log's last lines (only a line when they are as last time)."""
        stream = self._report_to if self._report_to is not None else sys.stderr
        lines = [f"{self._prog}: {child.spec.name} died ({reason}) after {ran_s:.1f}s; {action}."]
        if child.log_path is not None:
            if tail and repeated:
                lines.append(f"  its log ends as last time: {tail[-1]}")
            elif tail:
                lines.append(f"  last {len(tail)} line(s) of {child.log_path}:")
                lines += [f"  | {line}" for line in tail]
            else:
                lines.append(f"  it wrote nothing to {child.log_path} this time")
        try:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed terminal must not stop the supervision
            pass

    async def _until_dead_or_retired(self, child: Child, proc: asyncio.subprocess.Process) -> str | None:
        """Why the child died, or None when it is to be retired (it may still be running)."""
        if child.retiring:
            return None
        dead = asyncio.ensure_future(self._until_dead(child, proc))
        retire = asyncio.ensure_future(child._retire.wait())
        try:
            await asyncio.wait([dead, retire], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in (dead, retire):
                if not fut.done():
                    fut.cancel()
            await asyncio.gather(dead, retire, return_exceptions=True)
        if child.retiring:
            return None
        return dead.result()

    async def _terminate(self, child: Child, proc: asyncio.subprocess.Process, grace_s: float) -> None:
        """SIGTERM, wait up to ``grace_s``, SIGKILL."""
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            logger.warning("child did not stop in time name=%s pid=%d action=kill", child.spec.name, proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        logger.info("child stopped name=%s pid=%d code=%s", child.spec.name, proc.pid, proc.returncode)

    async def _until_dead(self, child: Child, proc: asyncio.subprocess.Process) -> str:
        """Returns why the child is gone: its exit, or a liveness URL that stopped answering."""
        url = child.spec.live_url
        if url is None:
            return exit_reason(await proc.wait())
        wait = asyncio.ensure_future(proc.wait())
        last_ok = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait([wait], timeout=_PROBE_INTERVAL_S)
                if done:
                    return exit_reason(wait.result())
                if await asyncio.to_thread(_probe, url, child.spec.live_ssl):
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
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        named = {c.spec.name: c for c in self.children}
        groups = [[named[n] for n in group if n in named] for group in order]
        listed = {id(c) for group in groups for c in group}
        groups.append([c for c in self.children if id(c) not in listed])
        for group in groups:
            await self._stop_group(group, grace_s)
        pumps = [p for c in self.children for p in (*c._old_pumps, c._pump) if p is not None]
        await asyncio.to_thread(lambda: [p.join(_DRAIN_WAIT_S) for p in pumps])  # the last lines land
        for child in self.children:
            child._pump, child._old_pumps = None, []
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
