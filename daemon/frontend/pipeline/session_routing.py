"""Session affinity in the frontend: one layer over every router mode.

A request names its session with the ``x-dynamo-session-id`` header (Dynamo's), or in the body with
``nvext.session_control.session_id`` (Dynamo's) or ``nvext.session_id``; the header wins. On
``/v1/messages`` the header and ``nvext`` count; ``metadata.user_id`` does not (it names a user, who
may run many sessions, and Dynamo does not read it either).

``SessionRouter`` wraps the model's router (round-robin, random or kv). For a request of a bound
session whose worker is routable (in discovery, ready, not quarantined, not failed by this request)
it pins the request there: round-robin and random send it there, the KV router sends it there
unless that worker is past its busy threshold (then it picks the best other worker by cost). A
session whose worker cannot take the request is routed by the mode and bound to the new worker:
it moves once and stays. The choice carries a ``SessionInfo`` for ``x-dynamo-route-explain``.

Disaggregated models: the binding is the decode worker's (the one that holds the session's KV
and decodes); the prefill pool is routed by its own router as before (in kv mode it finds the
session's prefix on the prefill worker that computed the last turn by itself), since a prefill
worker keeps nothing of the session after the transfer that affinity could preserve.

``SessionAffinity`` owns the per-model ``SessionTable``s (router core) and their replica sync,
built from ``--router-session-affinity-ttl-secs`` and ``--router-session-affinity-max-sessions``.
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dynamod.daemon.frontend.http.asgi import Scope, header
from dynamod.daemon.frontend.pipeline.routing import (
    DecodeEstimate,
    RouteChoice,
    Router,
    RouteRequest,
    SessionRef,
)
from dynamod.daemon.router.core.session_sync import SessionSync
from dynamod.daemon.router.core.sessions import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_TTL_S,
    SessionBinding,
    SessionTable,
    validate_session_settings,
)
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUS_SLEEPING, Instance
from dynamod.shared.protocol.routing import (
    SESSION_BUSY,
    SESSION_DRAINING,
    SESSION_GONE,
    SESSION_KEPT,
    SESSION_MOVED,
    SESSION_NEW,
    SESSION_SLEEPING,
    SESSION_UNAVAILABLE,
    STAGE_PREFILL,
    SessionInfo,
)

if TYPE_CHECKING:
    from dynamod.daemon.frontend.pipeline.models import ServedModel
    from dynamod.shared.runtime.distributed import DistributedRuntime

SESSION_HEADER = b"x-dynamo-session-id"
MAX_SESSION_ID_CHARS = 256  # bounds the table's memory per session


def check_session_id(value: str, source: str) -> str:
    text = value.strip()
    if not text:
        raise InvalidRequestError(f"empty session id in {source}", param=source)
    if len(text) > MAX_SESSION_ID_CHARS:
        raise InvalidRequestError(f"session id in {source} is longer than {MAX_SESSION_ID_CHARS} characters", param=source)
    return text


def session_of(scope: Scope, body: Any) -> SessionRef | None:
    """The request's session: the header's id, else the body's ``nvext``; the TTL and close
    action of ``nvext.session_control`` apply either way."""
    nvext = getattr(body, "nvext", None)
    from_body: SessionRef | None = nvext.session() if nvext is not None else None
    raw = header(scope, SESSION_HEADER)
    if raw is None:
        return from_body
    session_id = check_session_id(raw, "x-dynamo-session-id")
    if from_body is None:
        return SessionRef(session_id)
    return SessionRef(session_id, ttl_s=from_body.ttl_s, close=from_body.close)


class SessionRouter:
    """The ``Router`` of one served model with session affinity over ``inner``."""

    def __init__(self, inner: Router, table: SessionTable, model: ServedModel) -> None:
        self.inner = inner
        self.name = inner.name
        self._table = table
        self._model = model
        self._inflight: dict[str, tuple[str, tuple[int, int], bool]] = {}  # request -> session, worker, close

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        ref = request.session
        table = self._table
        if ref is None or request.stage == STAGE_PREFILL or not table.enabled:
            return await self.inner.select(request, candidates)
        sid = ref.session_id
        held, expired = table.lookup(sid)
        why = ""
        if held is not None:
            why = self.unfit(held.worker[0], candidates)
            request.pinned = None if why else held.worker
        choice = await self.inner.select(request, candidates)
        worker = (choice.worker_id, choice.dp_rank or 0)
        if held is not None and not why and worker == held.worker:
            table.keep(sid, held)
            outcome = SESSION_KEPT
        else:
            if held is not None and not why:
                why = SESSION_BUSY  # routable, yet the router passed it over: past its busy threshold
            table.bind(sid, worker, held, ref.ttl_s)
            outcome = SESSION_NEW if held is None else SESSION_MOVED
        choice.session = SessionInfo(
            session_id=sid, outcome=outcome, worker_id=worker[0], dp_rank=worker[1],
            held_worker_id=None if held is None else held.worker[0], held_dp_rank=None if held is None else held.worker[1],
            reason=why, expired=expired,
        )
        self._inflight[request.request_id] = (sid, worker, ref.close)
        return choice

    def unfit(self, worker_id: int, candidates: Sequence[Instance]) -> str:
        """Why the session's worker cannot take this request ('' when it can)."""
        if any(inst.instance_id == worker_id for inst in candidates):
            return ""
        found = self._model.live_instance(worker_id)
        if found is None:
            return SESSION_GONE
        status = found[0].status
        if status == STATUS_DRAINING:
            return SESSION_DRAINING
        if status == STATUS_SLEEPING:
            return SESSION_SLEEPING
        return SESSION_UNAVAILABLE  # quarantined, or this request already failed there

    def estimate(self, request: RouteRequest, candidates: Sequence[Instance]) -> DecodeEstimate | None:
        """The decode worker the request would get: its session's, when that one can take it."""
        ref = request.session
        if ref is not None and self._table.enabled:
            held: SessionBinding | None = self._table.lookup(ref.session_id)[0]
            if held is not None and not self.unfit(held.worker[0], candidates):
                request.pinned = held.worker
        return self.inner.estimate(request, candidates)

    def record(self, choice: RouteChoice, model: str) -> None:
        self.inner.record(choice, model)

    def on_first_token(self, request_id: str) -> None:
        self.inner.on_first_token(request_id)

    def on_finish(self, request_id: str) -> None:
        self.inner.on_finish(request_id)
        done = self._inflight.pop(request_id, None)
        if done is not None:
            sid, worker, close = done
            if close:
                self._table.close(sid)
            else:
                self._table.finished(sid, worker)


class SessionAffinity:
    """The session tables of this frontend (one per served model name) and their replica sync."""

    def __init__(self, ttl_s: float, max_sessions: int, runtime: DistributedRuntime, component: str) -> None:
        validate_session_settings(ttl_s, max_sessions)
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._rt = runtime
        self.router_id = secrets.randbits(63)
        self.tables: dict[str, SessionTable] = {}
        self.sync = SessionSync(runtime, component)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def wrap(self, router: Router, model: ServedModel) -> Router:
        if not self.enabled:
            return router
        table = self.tables.get(model.name)
        if table is None:
            table = SessionTable(self.ttl_s, self.max_sessions, router_id=self.router_id, registry=self._rt.registry)
            self.tables[model.name] = table
            self.sync.add_table(model.name, table)
        return SessionRouter(router, table, model)

    async def start(self) -> None:
        if self.enabled:
            await self.sync.start()

    async def close(self) -> None:
        await self.sync.close()


def add_session_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("session affinity")
    g.add_argument("--router-session-affinity-ttl-secs", type=float, default=None,
                   help="keep a session (x-dynamo-session-id, nvext.session_control) on its worker until it has been "
                        "idle this long; 0 turns affinity off "
                        f"[env DYN_ROUTER_SESSION_AFFINITY_TTL_SECS, default {DEFAULT_SESSION_TTL_S:g}]")
    g.add_argument("--router-session-affinity-max-sessions", type=int, default=None,
                   help="sessions remembered per model, least recently used out "
                        f"[env DYN_ROUTER_SESSION_AFFINITY_MAX_SESSIONS, default {DEFAULT_MAX_SESSIONS}]")


def session_settings_from_args(args: argparse.Namespace) -> tuple[float, int]:
    """(TTL seconds, max sessions): flag, else ``DYN_ROUTER_SESSION_AFFINITY_*``, else the default."""
    ttl = _resolve(args, "router_session_affinity_ttl_secs", "DYN_ROUTER_SESSION_AFFINITY_TTL_SECS", float, DEFAULT_SESSION_TTL_S)
    size = _resolve(args, "router_session_affinity_max_sessions", "DYN_ROUTER_SESSION_AFFINITY_MAX_SESSIONS", int,
                    DEFAULT_MAX_SESSIONS)
    validate_session_settings(ttl, size)
    return ttl, size


def _resolve(args: argparse.Namespace, name: str, env: str, parse: Any, default: Any) -> Any:
    value = getattr(args, name, None)
    if value is not None:
        return value
    text = os.environ.get(env, "")
    if not text:
        return default
    try:
        return parse(text)
    except ValueError:
        raise ConfigError(f"{env}={text!r} is not a number") from None
