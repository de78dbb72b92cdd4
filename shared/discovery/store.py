"""The narrow interface every discovery backend implements (etcd, file, mem).

A backend stores ``key -> bytes`` pairs, most of them attached to a *lease*: a lease must be kept
alive by its owner (every ``ttl/3``) and when it expires every key attached to it disappears. That
is how a dead process leaves discovery within one TTL without anybody cleaning up after it.

Watches deliver a snapshot first (one PUT per existing key) and then changes, and they survive a
backend outage: after a reconnect the watch resumes, and if it cannot resume exactly (history
compacted) it re-lists and emits the PUTs and DELETEs that make the watcher's view right again.
Likewise a lease lost during an outage is re-granted and its keys are put again by the backend.

A reader that needs the listing itself (to seed a map before it serves) takes ``list_prefix`` and
hands the listing to ``watch_prefix(prefix, after=listing)``: that watch starts right after the
read instead of with a snapshot, so a key deleted between the two reads is reported deleted rather
than silently missing, and nothing listed is told twice.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dynamod.shared.tasks import stop_task

DEFAULT_LEASE_TTL_S = 10.0


class WatchEventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: WatchEventKind
    key: str
    value: bytes | None = None  # None for DELETE


@dataclass(frozen=True, slots=True)
class PrefixListing:
    """The keys under ``prefix`` as one read saw them, and where the store stood at that read, so
    a watch can start right after it (``watch_prefix(prefix, after=listing)``)."""

    prefix: str
    items: Mapping[str, bytes]
    revision: int = 0  # etcd's store revision at the read; 0 where the backend keeps no history
    versions: Mapping[str, int] = field(default_factory=dict)  # etcd: each key's mod_revision


def diff_events(old: Mapping[str, bytes], new: Mapping[str, bytes]) -> list[WatchEvent]:
    """The DELETEs then PUTs (each in key order) that turn the view ``old`` into ``new``."""
    events = [WatchEvent(WatchEventKind.DELETE, k) for k in sorted(old.keys() - new.keys())]
    events += [WatchEvent(WatchEventKind.PUT, k, new[k]) for k in sorted(new) if old.get(k) != new[k]]
    return events


class LeaseBase:
    """What every backend's lease holds the same way: its id and TTL (read-only to the lease's
    users; a backend that re-grants sets ``_id``) and whether it was revoked."""

    def __init__(self, lease_id: int, ttl: float) -> None:
        self._id = lease_id
        self._ttl = ttl
        self.revoked = False

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return self._ttl


class KeptAliveLease(LeaseBase):
    """A lease a background task of this process keeps alive (etcd's keep-alive, the file
    store's heartbeat), with the keys put under it."""

    def __init__(self, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self.keys: dict[str, bytes] = {}
        self.task: asyncio.Task[None] | None = None

    async def retire(self, owned: list[Any]) -> bool:
        """The revoking side's first step: marks the lease revoked, drops it from its store's
        ``owned`` leases and stops its keep-alive. False when it was revoked already.

        The keep-alive's own cancellation is swallowed; a caller cancelled while waiting here
        gets its CancelledError, and the lease's keys then expire within its TTL."""
        if self.revoked:
            return False
        self.revoked = True
        if self in owned:
            owned.remove(self)
        await stop_task(self.task)
        return True


@runtime_checkable
class Lease(Protocol):
    """A lease owned by this process. Keys put with it vanish when it is revoked or expires."""

    @property
    def id(self) -> int: ...

    @property
    def ttl(self) -> float: ...

    async def revoke(self) -> None:
        """Ends the lease now: all its keys are deleted; keep-alive stops."""
        ...


@runtime_checkable
class DiscoveryStore(Protocol):
    """Key/value discovery with leases and prefix watches."""

    name: str  # "etcd" | "file" | "mem"

    async def start(self) -> None:
        """Connects (or opens the directory). Raises DiscoveryError with an actionable message."""
        ...

    async def close(self) -> None:
        """Stops keep-alives and watches; revokes this store's leases (their keys vanish)."""
        ...

    async def create_lease(self, ttl: float = DEFAULT_LEASE_TTL_S) -> Lease:
        """Grants a lease and keeps it alive in the background every ttl/3 until revoked/closed."""
        ...

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> None:
        """Creates or replaces ``key``. With a lease, the key lives as long as the lease does and is
        re-put by the backend if the lease had to be re-granted after an outage."""
        ...

    async def delete(self, key: str) -> None: ...

    async def get(self, key: str) -> bytes | None: ...

    async def get_prefix(self, prefix: str) -> dict[str, bytes]: ...

    async def list_prefix(self, prefix: str) -> PrefixListing:
        """``get_prefix`` with the position a watch can start from (``watch_prefix(after=)``)."""
        ...

    def watch_prefix(self, prefix: str, *, after: PrefixListing | None = None) -> AsyncIterator[WatchEvent]:
        """Snapshot (as PUTs) then changes under ``prefix``; resumes across outages. Closing the
        iterator (``aclose``) ends the watch. With ``after`` (this store's listing of the same
        prefix) there is no snapshot: first the changes since that listing, then the rest."""
        ...
