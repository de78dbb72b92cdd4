"""Who holds a listener's connection slots: peers that proved themselves, and a bounded few that
have not yet.

A listener with a cluster token or TLS cannot tell a member from a scanner until the handshake is
done, so a connection starts *pending* and becomes *established* once it passed (TLS finished,
hello with the token checked). Without this split, 40 idle connections that never sent a byte
filled a worker's ``--request-plane-max-connections 20`` and locked out the operator's ``dynamoctl``
and a restarted frontend holding the right token.

The rules (``ConnectionAdmission``), all applied when a connection is accepted, before it is read:

- at most ``max_pending`` connections pending in total and ``max_pending_per_peer`` from one
  address; past either, the *oldest* pending one (of that address, for the per-peer cap) is closed
  to make room. A member sends its hello the moment it connects, so it passes long before it is
  the oldest; a connection that sends nothing is the one that goes. Refusing the newcomer instead
  would let a few idle sockets lock out everyone.
- at most ``max_connections`` in all; when full, a pending connection is closed to make room, and
  only when every slot is held by an established peer is the newcomer refused (``overloaded``).
  So pending connections can never take the slots members need.
- the handshake deadline (``ServerGuard.handshake_timeout_s``) closes a pending connection that
  took too long, whatever the counts.

An open listener (no token, no TLS) establishes every connection at once: only the total applies.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_PER_PEER = 32
MAX_DEFAULT_PENDING = 256


def default_max_pending(max_connections: int) -> int:
    """A quarter of the slots, at most 256: members always keep three quarters."""
    return max(1, min(MAX_DEFAULT_PENDING, max_connections // 4))


@dataclass(frozen=True, slots=True)
class PreAuthLimits:
    """Caps on connections that have not finished their handshake; 0: the default."""

    max_pending: int = 0
    max_pending_per_peer: int = 0

    def resolve(self, max_connections: int) -> tuple[int, int]:
        if self.max_pending < 0 or self.max_pending_per_peer < 0:
            raise ConfigError("pending-connection caps must be 0 (default) or more")
        pending = self.max_pending or default_max_pending(max_connections)
        pending = min(pending, max_connections)
        per_peer = min(self.max_pending_per_peer or DEFAULT_MAX_PENDING_PER_PEER, pending)
        return pending, per_peer


class PendingConnection(Protocol):
    def evict_pending(self, reason: str) -> None:
        """Closes this not-yet-authenticated connection to make room for another."""


def peer_host(peer: object) -> str:
    """The address part of a peer (``(host, port, ...)`` tuple or ``host:port`` text)."""
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    text = str(peer)
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class ConnectionAdmission:
    """The slot table of one listener (module docstring). Not thread-safe: one event loop."""

    def __init__(self, what: str, max_connections: int, limits: PreAuthLimits | None = None) -> None:
        if max_connections < 1:
            raise ConfigError(f"{what}: max connections must be at least 1, got {max_connections}")
        self.what = what
        self.max_connections = max_connections
        self.max_pending, self.max_pending_per_peer = (limits or PreAuthLimits()).resolve(max_connections)
        self._pending: OrderedDict[PendingConnection, str] = OrderedDict()
        self._pending_by_host: dict[str, int] = {}
        self._established: set[object] = set()
        self.evicted = 0
        self.refused = 0
        self._logged_at = -1e9
        self._unlogged = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def established(self) -> int:
        return len(self._established)

    def open(self, conn: PendingConnection, peer: object) -> bool:
        """Takes a new connection as pending, closing older pending ones to make room; False when
        every slot is held by an established peer (the caller refuses the newcomer)."""
        host = peer_host(peer)
        if self._pending_by_host.get(host, 0) >= self.max_pending_per_peer:
            self._evict_oldest(host, "pending_per_peer")
        if len(self._pending) >= self.max_pending:
            self._evict_oldest(None, "pending")
        if len(self._pending) + len(self._established) >= self.max_connections:
            if not self._pending:
                self.refused += 1
                return False
            self._evict_oldest(None, "max_connections")
        self._pending[conn] = host
        self._pending_by_host[host] = self._pending_by_host.get(host, 0) + 1
        return True

    def establish(self, conn: object) -> None:
        """The connection passed its handshake: it now holds a member's slot."""
        if self._forget_pending(conn):  # type: ignore[arg-type]
            self._established.add(conn)

    def open_established(self, conn: object) -> bool:
        """An open listener's connection: established at once; False when full."""
        if len(self._pending) + len(self._established) >= self.max_connections:
            if not self._pending:
                self.refused += 1
                return False
            self._evict_oldest(None, "max_connections")
        self._established.add(conn)
        return True

    def close(self, conn: object) -> None:
        if not self._forget_pending(conn):  # type: ignore[arg-type]
            self._established.discard(conn)

    def _forget_pending(self, conn: PendingConnection) -> bool:
        host = self._pending.pop(conn, None)
        if host is None:
            return False
        left = self._pending_by_host[host] - 1
        if left:
            self._pending_by_host[host] = left
        else:
            del self._pending_by_host[host]
        return True

    def _evict_oldest(self, host: str | None, reason: str) -> None:
        victim = next((c for c, h in self._pending.items() if host is None or h == host), None)
        if victim is None:
            return
        victim_host = self._pending[victim]
        self._forget_pending(victim)
        self.evicted += 1
        self._log_eviction(victim_host, reason)
        victim.evict_pending(reason)

    def _log_eviction(self, host: str, reason: str) -> None:
        now = time.monotonic()
        if now - self._logged_at < 60.0:
            self._unlogged += 1
            return
        logger.warning(
            "%s.pending_evicted peer=%s reason=%s pending=%d established=%d max_pending=%d suppressed_since_last=%d",
            self.what, host, reason, len(self._pending), len(self._established), self.max_pending, self._unlogged,
        )
        self._logged_at = now
        self._unlogged = 0
