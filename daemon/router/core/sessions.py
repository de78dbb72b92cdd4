"""Session affinity state: which worker each session (``x-dynamo-session-id``) is bound to.

An agent's session sends turn after turn whose prompt repeats everything before it; its KV cache
is on the worker that served the last turn. The frontend binds a session to the worker its first
request was routed to (by whatever the router mode chose) and sends the session's later requests
there while the binding lives: ``ttl_s`` after its last request. When that worker cannot take the
request (gone, draining, asleep, unreachable, past its busy threshold) the session is routed by the
mode once more and bound to the new worker, where it stays: it moves once, not back and forth.

The table is bounded (``max_sessions``, least recently used out) and knows nothing of I/O, like
``KvRouter``: bindings made here are queued for the caller to publish to the other router replicas
(``SessionBound`` on ``session_affinity_events``), and theirs are applied with ``apply_remote``. A
binding with more moves (``epoch``) wins; at equal epochs the one made by the smaller router id
wins, so replicas that bound a new session at the same moment agree on one worker. Each replica
runs its own idle timer, refreshed by every binding it hears (Dynamo does the same).

Metrics: ``dynamo_router_sessions_total{outcome}`` (new, kept, moved, expired, evicted, closed)
and ``dynamo_router_sessions`` (bindings held).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.indexer import WorkerKey
from dynamod.shared.observability.per_registry import PerRegistry
from dynamod.shared.protocol.replica_sync import SessionBound
from dynamod.shared.protocol.routing import SESSION_KEPT, SESSION_MOVED, SESSION_NEW

logger = logging.getLogger(__name__)

DEFAULT_SESSION_TTL_S = 300.0  # Dynamo's session_control default timeout
DEFAULT_MAX_SESSIONS = 100_000  # ~200 bytes each: ~20 MB at the bound
MAX_SESSION_TTL_S = 31_536_000.0  # a year, Dynamo's upper bound
SYNC_OUTBOX_MAX = 10_000  # bindings waiting to be published; oldest dropped beyond

OUTCOME_EXPIRED = "expired"  # a binding's idle TTL ran out
OUTCOME_EVICTED = "evicted"  # pushed out by the size bound
OUTCOME_CLOSED = "closed"  # the client closed the session


class SessionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.outcomes = Counter(
            "dynamo_router_sessions",
            "Session-affinity lookups and bindings by outcome: new (bound on first use or after expiry), kept "
            "(routed to its worker), moved (its worker could not take it), expired, evicted (size bound), closed",
            ("outcome",),
            registry=registry,
        )
        self.tables: weakref.WeakSet[SessionTable] = weakref.WeakSet()
        self.held = Gauge("dynamo_router_session_bindings", "Session bindings held by this process's routers", registry=registry)
        self.held.set_function(lambda: float(sum(len(t) for t in list(self.tables))))


session_metrics = PerRegistry(SessionMetrics)


@dataclass(slots=True)
class SessionBinding:
    worker: WorkerKey
    epoch: int  # moves so far
    origin: int  # the router that made this binding
    ttl_s: float
    expires_at: float

    def key(self) -> tuple[int, int]:
        """Ordering between replicas' bindings: more moves first, then the smaller origin."""
        return (self.epoch, -self.origin)


class SessionTable:
    """The session bindings of one served model (the replica key of its sync messages)."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        *,
        router_id: int,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        sync: bool = True,
    ) -> None:
        validate_session_settings(ttl_s, max_sessions)
        self.ttl_s = float(ttl_s)
        self.max_sessions = int(max_sessions)
        self.router_id = router_id
        self._clock = clock
        self._sync = sync
        self._entries: OrderedDict[str, SessionBinding] = OrderedDict()  # least recently used first
        self._outbox: deque[SessionBound] = deque()
        self._outbox_dropped = 0
        self._outbox_ready = asyncio.Event()
        self.metrics = session_metrics(registry)
        self.metrics.tables.add(self)
        self._count = {o: self.metrics.outcomes.labels(o) for o in
                       (SESSION_NEW, SESSION_KEPT, SESSION_MOVED, OUTCOME_EXPIRED, OUTCOME_EVICTED, OUTCOME_CLOSED)}

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    # -- the local side ---------------------------------------------------------------------------

    def lookup(self, session_id: str) -> tuple[SessionBinding | None, bool]:
        """The session's live binding (None: none), and whether one had just expired."""
        entry = self._entries.get(session_id)
        expired = entry is not None and entry.expires_at <= self._clock()
        if expired:
            del self._entries[session_id]
            self._count[OUTCOME_EXPIRED].inc()
            entry = None
        self._expire_oldest()
        return entry, expired

    def keep(self, session_id: str, binding: SessionBinding) -> None:
        """The session's request went to its worker: its idle timer restarts (here and, through
        the published binding, on the other replicas)."""
        self._count[SESSION_KEPT].inc()
        if self._entries.get(session_id) is binding:
            self._refresh(session_id, binding)
            self._publish(session_id, binding)

    def bind(
        self, session_id: str, worker: WorkerKey, previous: SessionBinding | None, ttl_s: float | None = None
    ) -> SessionBinding:
        """Binds the session to ``worker`` after the mode routed it there: a new session
        (``previous`` None) or one that left ``previous``'s worker. Returns the binding in force:
        when a concurrent request (or a replica) bound the session meanwhile, that one stays and
        this request's worker is not remembered (the first binding wins)."""
        self._count[SESSION_MOVED if previous is not None else SESSION_NEW].inc()
        current = self._live(session_id)
        if current is not None and current is not previous:
            self._refresh(session_id, current)
            return current
        ttl = self.ttl_s if ttl_s is None else float(ttl_s)
        binding = SessionBinding(
            worker=(int(worker[0]), int(worker[1])),
            epoch=0 if previous is None else previous.epoch + 1,
            origin=self.router_id,
            ttl_s=ttl,
            expires_at=self._clock() + ttl,
        )
        self._store(session_id, binding)
        self._publish(session_id, binding)
        if previous is not None:
            logger.info(
                "session moved session_id=%s from_worker=%016x to_worker=%016x epoch=%d",
                session_id, previous.worker[0], binding.worker[0], binding.epoch,
            )
        return binding

    def finished(self, session_id: str, worker: WorkerKey) -> None:
        """A request of the session ended on ``worker``: the idle TTL counts from now (a request
        longer than the TTL must not leave its session unbound when it ends)."""
        entry = self._entries.get(session_id)
        if entry is not None and entry.worker == worker:
            self._refresh(session_id, entry)

    def close(self, session_id: str) -> None:
        """The client ended the session: forget it here and on the replicas."""
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return
        self._count[OUTCOME_CLOSED].inc()
        self._publish(session_id, entry, closed=True)

    # -- replicas ---------------------------------------------------------------------------------

    def apply_remote(self, ev: SessionBound) -> bool:
        """Applies another replica's binding (our own are ignored). Returns True when it changed
        or refreshed ours."""
        if ev.router_id == self.router_id:
            return False
        theirs = SessionBinding(
            worker=(ev.worker_id, ev.dp_rank), epoch=ev.epoch, origin=ev.origin,
            ttl_s=ev.ttl_s if ev.ttl_s > 0 else self.ttl_s, expires_at=0.0,
        )
        current = self._live(ev.session_id)
        if ev.closed:
            if current is not None and current.key() <= theirs.key():
                del self._entries[ev.session_id]
                return True
            return False
        if current is not None:
            if current.worker == theirs.worker and current.epoch == theirs.epoch:
                current.origin = min(current.origin, theirs.origin)
                self._refresh(ev.session_id, current)
                return True
            if current.key() >= theirs.key():
                return False  # ours has moved further, or was made by the smaller router id
        theirs.expires_at = self._clock() + theirs.ttl_s
        self._store(ev.session_id, theirs)
        return True

    def take_sync_events(self) -> list[SessionBound]:
        out = list(self._outbox)
        self._outbox.clear()
        self._outbox_ready.clear()
        return out

    async def next_sync_events(self) -> list[SessionBound]:
        """Waits for at least one binding to publish, then takes them all."""
        while not self._outbox:
            await self._outbox_ready.wait()
        return self.take_sync_events()

    # -- internals --------------------------------------------------------------------------------

    def _live(self, session_id: str) -> SessionBinding | None:
        entry = self._entries.get(session_id)
        if entry is not None and entry.expires_at <= self._clock():
            del self._entries[session_id]
            self._count[OUTCOME_EXPIRED].inc()
            return None
        return entry

    def _refresh(self, session_id: str, entry: SessionBinding) -> None:
        entry.expires_at = self._clock() + entry.ttl_s
        self._entries.move_to_end(session_id)

    def _store(self, session_id: str, binding: SessionBinding) -> None:
        self._entries[session_id] = binding
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)
            self._count[OUTCOME_EVICTED].inc()

    def _expire_oldest(self, limit: int = 8) -> None:
        """Drops a few expired bindings from the least recently used end, so sessions that never
        come back leave before the size bound pushes them out (bindings are refreshed in use
        order, so with one TTL the oldest expire first; a longer per-session TTL only delays
        the sweep behind it)."""
        now = self._clock()
        entries = self._entries
        for _ in range(limit):
            if not entries:
                return
            session_id, entry = next(iter(entries.items()))
            if entry.expires_at > now:
                return
            del entries[session_id]
            self._count[OUTCOME_EXPIRED].inc()

    def _publish(self, session_id: str, binding: SessionBinding, *, closed: bool = False) -> None:
        if not self._sync:
            return
        if len(self._outbox) >= SYNC_OUTBOX_MAX:
            self._outbox.popleft()
            self._outbox_dropped += 1
            if self._outbox_dropped % 1000 == 1:
                logger.warning("session sync outbox full dropped=%d", self._outbox_dropped)
        self._outbox.append(SessionBound(
            router_id=self.router_id, session_id=session_id, worker_id=binding.worker[0], dp_rank=binding.worker[1],
            epoch=binding.epoch, origin=binding.origin, ttl_s=binding.ttl_s, closed=closed,
        ))
        self._outbox_ready.set()


def validate_session_settings(ttl_s: float, max_sessions: int) -> None:
    if not 0 <= ttl_s <= MAX_SESSION_TTL_S:  # also rejects NaN
        raise ConfigError(f"--router-session-affinity-ttl-secs must be within [0, {MAX_SESSION_TTL_S:.0f}], got {ttl_s}")
    if max_sessions < 1:
        raise ConfigError(f"--router-session-affinity-max-sessions must be >= 1, got {max_sessions}")
