"""The narrow interface every discovery backend implements (etcd, file, mem).

A backend stores ``key -> bytes`` pairs, most of them attached to a *lease*: a lease must be kept
alive by its owner (every ``ttl/3``) and when it expires every key attached to it disappears. That
is how a dead process leaves discovery within one TTL without anybody cleaning up after it.

Watches deliver a snapshot first (one PUT per existing key) and then changes, and they survive a
backend outage: after a reconnect the watch resumes, and if it cannot resume exactly (history
compacted) it re-lists and emits the PUTs and DELETEs that make the watcher's view right again.
Likewise a lease lost during an outage is re-granted and its keys are put again by the backend.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

DEFAULT_LEASE_TTL_S = 10.0


class WatchEventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: WatchEventKind
    key: str
    value: bytes | None = None  # None for DELETE


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

    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """Snapshot (as PUTs) then changes under ``prefix``; resumes across outages. Closing the
        iterator (``aclose``) ends the watch."""
        ...
