"""One scan of the discovery directory per poll interval, shared by every watch of a store.

A process watches several prefixes at once (a frontend: instances of each endpoint, model cards,
the event plane's channels of each topic), and each watch used to list the whole keys directory
on its own every interval, in its own trip through the thread pool: most of an idle frontend's
CPU. ``SharedPoll`` lists it once per interval while anyone watches and hands the snapshot to
every watcher, which keeps only its prefix and diffs it against what it last reported.

A watcher ignores snapshots whose scan began before its own initial read, so it never reports a
key as gone (or an old value) that its initial read already had newer. Snapshots are shared: no
watcher may change one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

Snapshot = Mapping[str, Any]


class Watcher:
    """One watch's mailbox: the latest snapshot offered, newer ones replacing older unread ones
    (a watch reports differences, so only the newest state matters)."""

    __slots__ = ("_latest", "_ready")

    def __init__(self) -> None:
        self._latest: tuple[float, Snapshot] | None = None
        self._ready = asyncio.Event()

    def offer(self, started: float, snapshot: Snapshot) -> None:
        self._latest = (started, snapshot)
        self._ready.set()

    async def next(self, after: float, closed: asyncio.Event) -> Snapshot | None:
        """The next snapshot whose scan began at or after ``after``; None once ``closed`` is set."""
        while not closed.is_set():
            ready = asyncio.ensure_future(self._ready.wait())
            stop = asyncio.ensure_future(closed.wait())
            try:
                await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for fut in (ready, stop):
                    if not fut.done():
                        fut.cancel()
            if closed.is_set():
                return None
            self._ready.clear()
            latest = self._latest
            if latest is not None and latest[0] >= after:
                return latest[1]
        return None


class SharedPoll:
    """Runs ``scan`` (blocking; in a thread) every ``interval_s`` while there are watchers."""

    def __init__(self, scan: Callable[[], Snapshot], interval_s: float, closed: asyncio.Event) -> None:
        self._scan = scan
        self.interval_s = interval_s
        self._closed = closed
        self._watchers: set[Watcher] = set()
        self._task: asyncio.Task[None] | None = None
        self.scans = 0  # for tests and status: how many scans ran

    def subscribe(self) -> Watcher:
        watcher = Watcher()
        self._watchers.add(watcher)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="file-discovery-poll")
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failing = False
        while not self._closed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.interval_s)
                return
            if not self._watchers:
                return  # the next subscribe starts a new loop
            started = loop.time()
            try:
                snapshot = await asyncio.to_thread(self._scan)
            except OSError as exc:  # a transient file-system error must not end the watches
                if not failing:
                    logger.warning("file discovery watch scan failing error=%s", exc)
                failing = True
                continue
            if failing:
                logger.info("file discovery watch scan recovered")
                failing = False
            self.scans += 1
            for watcher in list(self._watchers):
                watcher.offer(started, snapshot)
