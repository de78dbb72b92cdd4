"""Helpers for the discovery integration tests: a registering child process and a watch recorder."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable

from dynamod.shared.discovery.store import DiscoveryStore, WatchEvent, WatchEventKind

REGISTER_SCRIPT = os.path.join(os.path.dirname(__file__), "register.py")


async def kill_and_reap(proc: asyncio.subprocess.Process | None) -> None:
    """Ends a child a test may have left stopped (SIGSTOP) or running, and reaps it."""
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()


class ChildRegistrar:
    """``register.py`` in its own process: the "other process" that registers keys."""

    def __init__(self, backend: str, target: str, ttl: float, entries: dict[str, str]) -> None:
        self.args = [backend, target, str(ttl), *(f"{k}={v}" for k, v in entries.items())]
        self.proc: asyncio.subprocess.Process | None = None
        self.lease_id = 0

    async def start(self, timeout: float = 20.0) -> ChildRegistrar:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            REGISTER_SCRIPT,
            *self.args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line.startswith(b"READY "):
            raise AssertionError(f"registrar did not start: {line!r} rc={self.proc.returncode}")
        self.lease_id = int(line.split()[1], 16)
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    async def close(self, timeout: float = 10.0) -> None:
        """Asks the child to close its store cleanly and waits for it to exit."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"close\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert line.strip() == b"CLOSED", line
        await asyncio.wait_for(self.proc.wait(), timeout)

    async def cleanup(self) -> None:
        await kill_and_reap(self.proc)


class Registrars:
    """The registrar children one test starts on one backend; ``cleanup`` ends all of them."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.started: list[ChildRegistrar] = []

    async def spawn(self, target: str, ttl: float, entries: dict[str, str]) -> ChildRegistrar:
        child = ChildRegistrar(self.backend, target, ttl, entries)
        self.started.append(child)
        return await child.start()

    async def cleanup(self) -> None:
        for child in self.started:
            await child.cleanup()


class WatchRecorder:
    """Consumes ``store.watch_prefix`` in a task and keeps the watcher's view (key -> value)."""

    def __init__(self, store: DiscoveryStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self.view: dict[str, bytes] = {}
        self.events: list[tuple[float, WatchEvent]] = []
        self._iter: AsyncIterator[WatchEvent] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> WatchRecorder:
        self._iter = self.store.watch_prefix(self.prefix)
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        assert self._iter is not None
        async for ev in self._iter:
            self.events.append((time.monotonic(), ev))
            if ev.kind is WatchEventKind.PUT:
                assert ev.value is not None
                self.view[ev.key] = ev.value
            else:
                self.view.pop(ev.key, None)

    async def wait_for(
        self, predicate: Callable[[dict[str, bytes]], bool], timeout: float, what: str
    ) -> float:
        """Waits until ``predicate(view)`` holds; returns the monotonic time it first held."""
        deadline = time.monotonic() + timeout
        while not predicate(self.view):
            if self._task is not None and self._task.done():
                self._task.result()
                raise AssertionError(f"watch ended while waiting for {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; view={self.view}")
            await asyncio.sleep(0.02)
        return time.monotonic()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._iter is not None:
            await self._iter.aclose()  # type: ignore[attr-defined]

    @property
    def ended(self) -> bool:
        return self._task is not None and self._task.done()

    async def wait_ended(self, timeout: float) -> None:
        """Waits until the watch has ended (the store closed it under the watcher)."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            assert time.monotonic() < deadline, "watch did not end on close()"
            await asyncio.sleep(0.02)


async def check_close_removes_keys(store: DiscoveryStore, prefix: str, child: ChildRegistrar, within: float) -> None:
    """``child`` holds two keys under ``prefix`` on a long lease: its clean ``close()`` must remove both
    within ``within`` seconds (well below the TTL: the lease is revoked, not left to expire)."""
    watch = WatchRecorder(store, prefix).start()
    await watch.wait_for(lambda v: len(v) == 2, within, "snapshot")
    closed_at = time.monotonic()
    await child.close()
    gone_at = await watch.wait_for(lambda v: not v, within, "keys removed by close()")
    assert gone_at - closed_at < within
    await watch.stop()
