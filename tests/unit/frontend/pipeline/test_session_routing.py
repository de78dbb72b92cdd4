"""Session affinity in the frontend: where the session id comes from, and the session layer over
round-robin and the KV router (kept, moved once on drain / departure / busy, explained)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.frontend.openai.schema import decode_chat_request
from dynamod.daemon.frontend.pipeline.kv_routing import KvGroup, KvModelRouter
from dynamod.daemon.frontend.pipeline.request import EngineRequest
from dynamod.daemon.frontend.pipeline.routing import RandomRouter, RoundRobinRouter, RouteRequest, SessionRef
from dynamod.daemon.frontend.pipeline.session_routing import SessionRouter, session_of
from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.daemon.router.core.sessions import SessionTable
from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUS_READY, Instance


def _inst(iid: int, status: str = STATUS_READY) -> Instance:
    return Instance(namespace="dynamo", component="backend", endpoint="generate", instance_id=iid, transport="tcp",
                    address="x:1", status=status)


class Fleet:
    """The model's workers as discovery shows them (``live_instance`` is all the layer reads)."""

    def __init__(self, *ids: int) -> None:
        self.workers = {i: _inst(i) for i in ids}

    def live_instance(self, worker_id: int) -> tuple[Instance, object] | None:
        inst = self.workers.get(worker_id)
        return None if inst is None else (inst, object())

    def candidates(self) -> list[Instance]:
        return [i for i in self.workers.values() if i.routable]


def _layer(inner: object, fleet: Fleet) -> SessionRouter:
    table = SessionTable(60, 100, router_id=1, registry=CollectorRegistry())
    return SessionRouter(inner, table, fleet)  # type: ignore[arg-type]


async def _route(router: SessionRouter, fleet: Fleet, rid: str, session: str | None, tokens: list[int] | None = None):
    req = RouteRequest(rid, tokens or [], session=SessionRef(session) if session else None)
    choice = await router.select(req, fleet.candidates())
    router.on_finish(rid)
    return choice


# -- where the id comes from ------------------------------------------------------------------------


def _scope(*headers: tuple[bytes, bytes]) -> dict:
    return {"headers": list(headers)}


def test_header_wins_and_session_control_adds_ttl_and_close() -> None:
    body = decode_chat_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "nvext": {"session_control": {"session_id": "from-body", "action": "close", "timeout": 30}},
    }).encode())
    assert session_of(_scope(), body) == SessionRef("from-body", ttl_s=30.0, close=True)
    assert session_of(_scope((b"x-dynamo-session-id", b" hdr ")), body) == SessionRef("hdr", ttl_s=30.0, close=True)
    plain = decode_chat_request(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"nvext":{"session_id":"s1"}}')
    assert session_of(_scope(), plain) == SessionRef("s1")
    assert session_of(_scope(), SimpleNamespace()) is None  # a body without nvext


@pytest.mark.parametrize("value", [b"   ", b"x" * 257])
def test_bad_header_is_a_400(value: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        session_of(_scope((b"x-dynamo-session-id", value)), SimpleNamespace())


def test_bad_nvext_sessions_are_400s() -> None:
    with pytest.raises(InvalidRequestError):
        decode_chat_request(b'{"model":"m","messages":[],"nvext":{"session_control":{"session_id":"a","action":"pause"}}}')
    conflicting = decode_chat_request(
        b'{"model":"m","messages":[],"nvext":{"session_id":"a","session_control":{"session_id":"b"}}}'
    )
    with pytest.raises(InvalidRequestError):
        session_of(_scope(), conflicting)


# -- round-robin ------------------------------------------------------------------------------------


async def test_round_robin_session_stays_then_moves_once_on_drain() -> None:
    fleet = Fleet(1, 2, 3)
    router = _layer(RoundRobinRouter(), fleet)
    picks = [(await _route(router, fleet, f"r{i}", "sess")).worker_id for i in range(12)]
    assert len(set(picks)) == 1
    home = picks[0]
    # Requests without a session still take turns over all three.
    assert {(await _route(router, fleet, f"n{i}", None)).worker_id for i in range(3)} == {1, 2, 3}

    fleet.workers[home] = _inst(home, STATUS_DRAINING)
    moved = await _route(router, fleet, "m", "sess")
    assert moved.worker_id != home
    info = moved.session
    assert info is not None and info.outcome == "moved" and info.reason == "draining" and info.held_worker_id == home
    fleet.workers[home] = _inst(home)  # back: the session does not bounce back
    after = [await _route(router, fleet, f"a{i}", "sess") for i in range(6)]
    assert {c.worker_id for c in after} == {moved.worker_id}
    assert all(c.session.outcome == "kept" for c in after)


async def test_random_mode_keeps_sessions_too() -> None:
    fleet = Fleet(1, 2, 3)
    router = _layer(RandomRouter(random.Random(7)), fleet)
    for s in ("a", "b", "c", "d"):
        assert len({(await _route(router, fleet, f"{s}{i}", s)).worker_id for i in range(12)}) == 1
    assert len({(await _route(router, fleet, f"n{i}", None)).worker_id for i in range(30)}) == 3


async def test_departed_and_failed_workers_move_the_session() -> None:
    fleet = Fleet(1, 2, 3)
    router = _layer(RoundRobinRouter(), fleet)
    home = (await _route(router, fleet, "r0", "s")).worker_id
    del fleet.workers[home]
    c = await _route(router, fleet, "r1", "s")
    assert c.session.reason == "gone" and c.worker_id != home
    # A request that failed on the session's worker (migration) is routed without it.
    second = c.worker_id
    req = RouteRequest("r2", [], session=SessionRef("s"))
    c2 = await router.select(req, [i for i in fleet.candidates() if i.instance_id != second])
    assert c2.session.outcome == "moved" and c2.session.reason == "unavailable"


async def test_close_ends_the_binding_and_new_sessions_spread() -> None:
    fleet = Fleet(1, 2, 3)
    router = _layer(RoundRobinRouter(), fleet)
    homes = {(await _route(router, fleet, f"r{i}", f"s{i}")).worker_id for i in range(3)}
    assert homes == {1, 2, 3}  # each new session is routed by the mode
    req = RouteRequest("c", [], session=SessionRef("s0", close=True))
    assert (await router.select(req, fleet.candidates())).session.outcome == "kept"
    router.on_finish("c")
    assert (await _route(router, fleet, "again", "s0")).session.outcome == "new"


def test_route_explain_names_the_session() -> None:
    from dynamod.daemon.frontend.pipeline.routing import RouteChoice
    from dynamod.shared.protocol.routing import SessionInfo

    choice = RouteChoice(_inst(0xAB))
    choice.session = SessionInfo(session_id="s", outcome="moved", worker_id=0xAB, held_worker_id=0xCD, held_dp_rank=0,
                                 reason="draining")
    engine = EngineRequest(request_id="r", model=None, preprocessed=None, started_at=0.0)  # type: ignore[arg-type]
    engine.decode_route = choice
    body = json.loads(engine.explain_header() or "{}")
    assert body["reason"] == "no_kv_router"
    assert body["session"] == {"id": "s", "outcome": "moved", "worker_id": f"{0xAB:016x}", "dp_rank": 0,
                               "held_worker_id": f"{0xCD:016x}", "held_dp_rank": 0, "reason": "draining"}


# -- kv ---------------------------------------------------------------------------------------------


class _Decisions:
    def offer(self, decision: object, model: str) -> None:
        return None


async def test_kv_session_moves_off_a_busy_worker_to_the_kv_choice() -> None:
    fleet = Fleet(1, 2, 3)
    kv = KvRouter(KvRouterConfig(active_prefill_tokens_threshold=40), 4, registry=CollectorRegistry(), core=None)
    inner = KvModelRouter(KvGroup("m", kv, 1), None, "m", _Decisions())  # type: ignore[arg-type]
    router = _layer(inner, fleet)
    tokens = list(range(32))
    first = await router.select(RouteRequest("a", tokens, session=SessionRef("s")), fleet.candidates())
    home = first.worker_id
    router.on_finish("a")
    kept = await router.select(RouteRequest("b", tokens, session=SessionRef("s")), fleet.candidates())
    assert kept.worker_id == home and kept.explain.reason == "session" and kept.session.outcome == "kept"
    # Request b still prefills 32 tokens there; another 32-token prompt puts the worker past 40.
    other = await inner.select(RouteRequest("load", list(range(500, 532)), pinned=(home, 0)), fleet.candidates())
    assert other.worker_id == home
    moved = await router.select(RouteRequest("c", tokens, session=SessionRef("s")), fleet.candidates())
    assert moved.worker_id != home
    assert moved.session.outcome == "moved" and moved.session.reason == "busy"
    assert msgspec.to_builtins(moved.explain.busy)[0][0] == home
