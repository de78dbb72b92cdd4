"""In-process discovery (``mem``): one process, for unit tests and single-process tools.

It follows the same semantics as the real backends (leases expire if not kept alive, watches give
a snapshot then changes) so that code tested on it behaves the same on etcd.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator

from dynamod.shared.discovery.store import (
    DEFAULT_LEASE_TTL_S,
    LeaseBase,
    PrefixListing,
    WatchEvent,
    WatchEventKind,
    diff_events,
)
from dynamod.shared.errors import DiscoveryError

_WATCH_QUEUE_SIZE = 10_000


class MemLease(LeaseBase):
    def __init__(self, store: MemStore, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self._store = store
        self.expires_at = time.monotonic() + ttl
        self.keys: set[str] = set()

    def refresh(self) -> None:
        self.expires_at = time.monotonic() + self._ttl

    async def revoke(self) -> None:
        self._store._drop_lease(self)


class MemStore:
    """A dict with leases and watchers. ``expire_leases`` lets tests simulate a dead owner."""

    name = "mem"

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._key_lease: dict[str, MemLease] = {}
        self._leases: dict[int, MemLease] = {}
        self._watchers: list[tuple[str, asyncio.Queue[WatchEvent | None]]] = []
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self._ids = itertools.count(random.randrange(1 << 40, 1 << 48))

    async def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_loop(), name="mem-discovery-reaper")

    async def close(self) -> None:
        self._closed = True
        for lease in list(self._leases.values()):
            self._drop_lease(lease)
        reaper, self._reaper = self._reaper, None
        for _, q in self._watchers:
            q.put_nowait(None)
        self._watchers.clear()
        if reaper is not None:
            reaper.cancel()
            # The reaper's own cancellation is absorbed; the caller's, while waiting here, is not.
            await asyncio.gather(reaper, return_exceptions=True)

    async def create_lease(self, ttl: float = DEFAULT_LEASE_TTL_S) -> MemLease:
        self._check_open()
        lease = MemLease(self, next(self._ids), ttl)
        self._leases[lease.id] = lease
        return lease

    def keepalive(self, lease: MemLease) -> None:
        """The owner's heartbeat. The mem backend refreshes owned leases itself in the reaper."""
        lease.refresh()

    async def put(self, key: str, value: bytes, lease: MemLease | None = None) -> None:  # type: ignore[override]
        self._check_open()
        if lease is not None:
            if lease.revoked:
                raise DiscoveryError(f"lease {lease.id:x} was revoked; cannot put {key}")
            lease.keys.add(key)
            self._key_lease[key] = lease
        else:
            old = self._key_lease.pop(key, None)
            if old:
                old.keys.discard(key)
        self._data[key] = value
        self._notify(WatchEvent(WatchEventKind.PUT, key, value))

    async def delete(self, key: str) -> None:
        self._delete(key)

    async def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    async def list_prefix(self, prefix: str) -> PrefixListing:
        return PrefixListing(prefix, await self.get_prefix(prefix))

    async def watch_prefix(  # type: ignore[override]
        self, prefix: str, *, after: PrefixListing | None = None
    ) -> AsyncIterator[WatchEvent]:
        self._check_open()
        queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue(_WATCH_QUEUE_SIZE)
        now = {k: v for k, v in self._data.items() if k.startswith(prefix)}
        # No await from here to the registration below: no change can fall between the two.
        if after is None:
            for k, v in now.items():
                queue.put_nowait(WatchEvent(WatchEventKind.PUT, k, v))
        else:
            for ev in diff_events(after.items, now):
                queue.put_nowait(ev)
        entry = (prefix, queue)
        self._watchers.append(entry)
        try:
            while True:
                ev = await queue.get()
                if ev is None:
                    return
                yield ev
        finally:
            if entry in self._watchers:
                self._watchers.remove(entry)

    # -- test helpers ------------------------------------------------------------------------

    def expire_lease(self, lease_id: int) -> None:
        """Simulates a lease whose owner died: its keys vanish as on etcd after the TTL."""
        lease = self._leases.get(lease_id)
        if lease:
            self._drop_lease(lease)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError("mem discovery store is closed")

    def _delete(self, key: str) -> None:
        if key in self._data:
            del self._data[key]
            lease = self._key_lease.pop(key, None)
            if lease:
                lease.keys.discard(key)
            self._notify(WatchEvent(WatchEventKind.DELETE, key))

    def _drop_lease(self, lease: MemLease) -> None:
        lease.revoked = True
        self._leases.pop(lease.id, None)
        for key in list(lease.keys):
            self._delete(key)

    def _notify(self, ev: WatchEvent) -> None:
        for prefix, q in self._watchers:
            if ev.key.startswith(prefix):
                if q.full():  # a stuck watcher must not grow memory; it loses the oldest change
                    q.get_nowait()
                q.put_nowait(ev)

    async def _reap_loop(self) -> None:
        # Leases of this process are alive while the process (and so the store) is: refresh them.
        while True:
            await asyncio.sleep(1.0)
            for lease in list(self._leases.values()):
                lease.refresh()
