"""The session table: idle TTL, the LRU bound, moves, replica sync; the KV router's session pin."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.daemon.router.core.session_sync import SessionSync
from dynamod.daemon.router.core.sessions import SessionTable
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.replica_sync import SessionEnvelope, session_envelope_encoder
from dynamod.shared.protocol.routing import REASON_SESSION


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _table(clock: Clock, *, ttl: float = 60.0, size: int = 100, router_id: int = 1,
           registry: CollectorRegistry | None = None) -> SessionTable:
    return SessionTable(ttl, size, router_id=router_id, clock=clock, registry=registry or CollectorRegistry())


def _count(table: SessionTable, outcome: str) -> float:
    return table.metrics.outcomes.labels(outcome)._value.get()


def test_binding_lives_for_the_ttl_after_its_last_use() -> None:
    clock = Clock()
    t = _table(clock, ttl=60)
    assert t.lookup("s") == (None, False)
    b = t.bind("s", (7, 0), None)
    clock.t += 50
    held, expired = t.lookup("s")
    assert held is b and not expired
    t.keep("s", held)  # used: the idle timer restarts
    clock.t += 50
    assert t.lookup("s")[0] is b
    clock.t += 60
    assert t.lookup("s") == (None, True)
    assert _count(t, "expired") == 1 and _count(t, "new") == 1 and _count(t, "kept") == 1
    assert len(t) == 0


def test_finished_request_restarts_the_idle_timer() -> None:
    clock = Clock()
    t = _table(clock, ttl=10)
    t.bind("s", (7, 0), None)
    clock.t += 9
    t.finished("s", (7, 0))  # a long request ended now
    clock.t += 9
    assert t.lookup("s")[0] is not None
    t.finished("s", (8, 0))  # another worker's request: not this binding's
    clock.t += 2
    assert t.lookup("s") == (None, True)


def test_size_bound_drops_least_recently_used() -> None:
    clock = Clock()
    t = _table(clock, size=3)
    for i in range(3):
        t.bind(f"s{i}", (i, 0), None)
    t.keep("s0", t.lookup("s0")[0])  # s0 used last: s1 is now the oldest
    t.bind("s3", (3, 0), None)
    assert len(t) == 3
    assert "s1" not in t and all(s in t for s in ("s0", "s2", "s3"))
    assert _count(t, "evicted") == 1


def test_sessions_that_never_return_leave_by_ttl() -> None:
    clock = Clock()
    t = _table(clock, ttl=5)
    for i in range(4):
        t.bind(f"old{i}", (1, 0), None)
    clock.t += 6
    t.lookup("other")  # any lookup sweeps the expired oldest
    assert len(t) == 0


def test_move_bumps_the_epoch_and_sticks() -> None:
    clock = Clock()
    t = _table(clock)
    first = t.bind("s", (1, 0), None)
    moved = t.bind("s", (2, 0), first)
    assert moved.worker == (2, 0) and moved.epoch == 1
    assert t.lookup("s")[0] is moved
    assert _count(t, "moved") == 1


def test_concurrent_first_requests_keep_the_first_binding() -> None:
    clock = Clock()
    t = _table(clock)
    a = t.bind("s", (1, 0), None)
    b = t.bind("s", (2, 0), None)  # a second request routed before it saw the binding
    assert b is a and t.lookup("s")[0].worker == (1, 0)


def test_close_forgets_the_session() -> None:
    clock = Clock()
    t = _table(clock)
    t.bind("s", (1, 0), None)
    t.close("s")
    assert t.lookup("s") == (None, False)
    assert _count(t, "closed") == 1


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError):
        SessionTable(-1, 10, router_id=1, registry=CollectorRegistry())
    with pytest.raises(ConfigError):
        SessionTable(60, 0, router_id=1, registry=CollectorRegistry())


# -- replica sync -----------------------------------------------------------------------------------


def _exchange(src: SessionTable, dst: SessionTable) -> None:
    for ev in src.take_sync_events():
        dst.apply_remote(ev)


def test_a_replica_routes_the_session_where_the_first_bound_it() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    a, b = _table(clock, router_id=1, registry=reg), _table(clock, router_id=2, registry=reg)
    first = a.bind("s", (5, 0), None)
    _exchange(a, b)
    held = b.lookup("s")[0]
    assert held is not None and held.worker == (5, 0)
    # B moves it (its worker drained) while A, not yet told, refreshes the old binding.
    b.bind("s", (6, 0), held)
    a.keep("s", first)
    _exchange(a, b)  # the stale refresh does not undo B's move
    assert b.lookup("s")[0].worker == (6, 0)
    _exchange(b, a)  # A adopts the move, which outranks its own binding
    assert a.lookup("s")[0].worker == (6, 0)
    assert a.lookup("s")[0].epoch == 1


def test_replicas_binding_a_new_session_at_once_agree() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    a, b = _table(clock, router_id=9, registry=reg), _table(clock, router_id=3, registry=reg)
    a.bind("s", (1, 0), None)
    b.bind("s", (2, 0), None)
    ea, eb = a.take_sync_events(), b.take_sync_events()
    for ev in eb:
        a.apply_remote(ev)
    for ev in ea:
        b.apply_remote(ev)
    assert a.lookup("s")[0].worker == b.lookup("s")[0].worker == (2, 0)  # router 3's binding


def test_remote_refresh_keeps_the_session_alive_and_close_travels() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    a, b = _table(clock, ttl=10, router_id=1, registry=reg), _table(clock, ttl=10, router_id=2, registry=reg)
    a.bind("s", (5, 0), None)
    _exchange(a, b)
    for _ in range(3):
        clock.t += 8
        a.keep("s", a.lookup("s")[0])
        _exchange(a, b)
    assert b.lookup("s")[0] is not None  # 24 s after the binding, refreshed by A's requests
    a.close("s")
    _exchange(a, b)
    assert b.lookup("s") == (None, False)


def test_sync_envelope_round_trip_applies_to_the_same_model() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    a, b = _table(clock, router_id=1, registry=reg), _table(clock, router_id=2, registry=reg)
    a.bind("s", (5, 1), None)
    sync = SessionSync(runtime=None, component="frontend")  # type: ignore[arg-type]  # apply needs no runtime
    sync.add_table("model-a", b)
    payload = session_envelope_encoder.encode(SessionEnvelope(model="model-a", sessions=a.take_sync_events()))
    assert sync.apply(payload) == 1
    assert b.lookup("s")[0].worker == (5, 1)
    other = session_envelope_encoder.encode(SessionEnvelope(model="model-b", sessions=[]))
    assert sync.apply(other) == 0 and sync.apply(b"\x00garbage") == 0
    assert b.take_sync_events() == []  # adopted bindings are not echoed back


# -- the KV router's pin ----------------------------------------------------------------------------


def _kv(**cfg: object) -> KvRouter:
    router = KvRouter(KvRouterConfig(**cfg), 4, registry=CollectorRegistry(), core=None)  # type: ignore[arg-type]
    router.update_workers([(1, 0), (2, 0), (3, 0)])
    return router


def test_kv_pin_wins_over_a_cheaper_worker() -> None:
    kv = _kv()
    tokens = list(range(16))
    pinned = kv.select_worker("r1", tokens).worker  # now the most loaded worker
    assert kv.best_worker("probe", tokens).worker != pinned
    d = kv.select_worker("r2", tokens, pinned=pinned)
    assert d.worker == pinned and d.reason == REASON_SESSION
    assert len(d.candidates) == 3  # the costs of all are still explained
    assert d.winner.cost > min(c.cost for c in d.candidates)


def test_kv_pin_of_a_busy_worker_routes_elsewhere() -> None:
    kv = _kv(active_prefill_tokens_threshold=10)
    d1 = kv.select_worker("r1", list(range(64)))  # 64 prefill tokens: that worker is now busy
    d2 = kv.select_worker("r2", list(range(100, 164)), pinned=d1.worker)
    assert d2.worker != d1.worker and d2.reason != REASON_SESSION
    assert any(w == d1.worker_id for w, _, _ in d2.busy)
