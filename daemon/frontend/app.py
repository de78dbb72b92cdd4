"""The frontend's Starlette application: routes, and the small informational endpoints.

    POST /v1/chat/completions   POST /v1/completions   POST /v1/embeddings   GET /v1/models
    POST /v1/responses   GET|DELETE /v1/responses/{id}
    POST /v1/messages   POST /v1/messages/count_tokens   (Anthropic's Messages API: ``anthropic/``)
    GET  /health (503 while shutting down)   GET /live   GET /metrics   GET /openapi.json
    GET  /v1/traces?request_id=ID|trace_id=ID|slowest=N   (recent requests' spans: pipeline/tracing.py)

Every request first passes the doors (``http/request_checks.FrontDoors``: API key, rate, body size,
admission).

Unknown paths and methods get OpenAI-shaped 404/405 bodies (Anthropic-shaped under
``/v1/messages``, as every refusal there, the doors' included); an exception goes through the error
boundary (``errors.to_http_error``) like the generation routes': its class's status, never a
traceback (a bug is logged and answered with a 500).
"""

from __future__ import annotations

import json
import uuid
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamod.daemon.frontend.anthropic.endpoint import CountTokensEndpoint, MessagesEndpoint
from dynamod.daemon.frontend.anthropic.errors import anthropic_error_body, to_anthropic_error
from dynamod.daemon.frontend.http.asgi import Scope, send_bytes, send_error, send_json
from dynamod.daemon.frontend.http.errors import HttpError, error_body, to_http_error
from dynamod.daemon.frontend.http.fleet_metrics import wants_process_scope
from dynamod.daemon.frontend.http.request_checks import HEALTH_DETAILS, DoorSettings, FrontDoors
from dynamod.daemon.frontend.openai.chat import ChatCompletionsEndpoint
from dynamod.daemon.frontend.openai.completions import CompletionsEndpoint
from dynamod.daemon.frontend.openai.embeddings import EmbeddingsEndpoint
from dynamod.daemon.frontend.openai.openapi import OpenApiEndpoint
from dynamod.daemon.frontend.openai.responses.endpoint import ResponsesEndpoint, StoredResponsesEndpoint
from dynamod.daemon.frontend.openai.responses.store import ResponseStore
from dynamod.daemon.frontend.openai.schema import ModelList, ModelObject, encoder
from dynamod.daemon.frontend.pipeline.state import FrontendState
from dynamod.daemon.frontend.pipeline.tracing import requests_summary
from dynamod.shared.errors import DynamoError, InvalidRequestError, NotFoundError
from dynamod.shared.observability import tracing
from dynamod.shared.protocol.worker_id import worker_id_hex


def _model_object(model: Any) -> ModelObject:
    card = model.card
    return ModelObject(
        id=model.name,
        created=model.created,
        parent=card.base_model if card.lora else None,
        root=card.base_model if card.lora else model.name,
        max_model_len=card.context_length or None,
    )


class ModelsEndpoint:
    """``GET /v1/models`` lists every served model; ``GET /v1/models/{id}`` retrieves one."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        registry = self.state.registry
        model_id = scope.get("path_params", {}).get("model_id")
        if model_id is None:
            data = [_model_object(m) for m in registry.all_models()]
            await send_json(send, 200, encoder.encode(ModelList(data=data)))
            return
        model = registry.models.get(model_id) or registry.embedding_models.get(model_id)
        if model is None:
            await send_error(send, to_http_error(NotFoundError(f"the model {model_id!r} does not exist")))
            return
        await send_json(send, 200, encoder.encode(_model_object(model)))


class HealthEndpoint:
    """200 while serving, 503 once shutdown began; the body names models, workers and pids, except
    to a caller without an API key when keys are on (the doors mark it): status only."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        state = self.state
        if not scope.get(HEALTH_DETAILS, True):
            status = b'{"status":"draining"}' if state.draining else b'{"status":"healthy"}'
            await send_json(send, 503 if state.draining else 200, status)
            return
        models = []
        instances = []
        for model in state.registry.all_models():
            workers = []
            for wid, pool in sorted(model.workers.items()):
                inst = pool.instances.get(wid)
                status = inst.status if inst is not None else "registering"
                if wid in state.dispatcher.quarantine:
                    status = "unreachable"
                workers.append({"instance_id": worker_id_hex(wid), "status": status})
            ready = sum(1 for w in workers if w["status"] == "ready")
            entry: dict[str, Any] = {"model": model.name, "lora": model.card.lora, "workers": workers, "ready": ready}
            if model.card.embedding is not None:
                entry["type"] = "embedding"
            if model.prefill is not None:
                # Disaggregated: the prefill pool beside the decode workers.
                prefill = model.prefill.candidates(state.dispatcher.quarantine)
                entry["prefill_ready"] = len(prefill)
                entry["prefill_workers"] = sorted(worker_id_hex(i.instance_id) for i in prefill)
            models.append(entry)
        for pool in state.registry.pools():
            for inst in sorted(pool.instances.values(), key=lambda i: i.instance_id):
                instances.append(
                    {
                        "component": inst.component,
                        "endpoint": inst.endpoint,
                        "instance_id": worker_id_hex(inst.instance_id),
                        "status": inst.status,
                        "address": inst.address,
                        "pid": inst.pid,
                        "node": inst.node,
                    }
                )
        body = {
            "status": "draining" if state.draining else "healthy",
            "pid": state.pid,
            "frontend_pids": _fleet_pids(state),
            "inflight": state.inflight,
            "router_mode": state.config.router_mode,
            "models": models,
            "instances": instances,
        }
        await send_json(send, 503 if state.draining else 200, json.dumps(body).encode())


async def live(scope: Scope, receive: Any, send: Any) -> None:
    await send_json(send, 200, b'{"status":"live"}')


def _fleet_pids(state: FrontendState) -> list[int]:
    """This process and the other frontends on its port (copies it started, peers in discovery)."""
    pids = state.frontend_pids or [state.pid]
    if state.fleet_metrics is not None:
        pids = sorted({*pids, *state.fleet_metrics.member_pids()})
    return pids


class MetricsEndpoint:
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        fleet = self.state.fleet_metrics
        if fleet is not None and not wants_process_scope(scope):
            body = await fleet.exposition()
        else:
            body = generate_latest(self.state.metrics.registry)
        await send_bytes(send, 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])


TRACES_MAX_LIMIT = 10_000


def traces_reply(query_string: str) -> tuple[int, bytes]:
    """``GET /v1/traces``'s status and JSON body for a query string: ``request_id=ID`` (or
    ``trace_id=``) gives the spans this process holds for a request, ``{"object": "list", "data":
    [span...]}``; ``slowest=N`` the N slowest recent requests it holds, ``{"object": "list",
    "requests": [...]}``; bad input an OpenAI-style error. One handler for the public port
    (``TracesEndpoint``) and a fleet member's private status server (``main.py``)."""
    query = parse_qs(query_string)

    def one(name: str) -> str | None:
        values = query.get(name)
        return values[-1] if values else None

    try:
        slowest = one("slowest")
        if slowest is not None:
            n = _bounded_int("slowest", slowest, TRACES_MAX_LIMIT)
            body: dict[str, Any] = {"object": "list", "requests": requests_summary(n)}
        else:
            request_id, trace_id = one("request_id"), one("trace_id")
            if request_id is None and trace_id is None:
                raise InvalidRequestError("give request_id, trace_id or slowest", param="request_id")
            limit = _bounded_int("limit", one("limit") or "1000", TRACES_MAX_LIMIT)
            spans = tracing.tracer().ring.find(request_id, trace_id, limit)
            body = {"object": "list", "data": tracing.spans_as_dicts(spans)}
    except DynamoError as exc:
        error = to_http_error(exc)
        return error.status, error.body
    if not tracing.tracer().enabled:
        body["note"] = tracing.TRACING_OFF_NOTE
    return 200, json.dumps(body, separators=(",", ":")).encode()


class TracesEndpoint:
    """``GET /v1/traces`` on the public port (``traces_reply``). Same auth as /metrics."""

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        status, body = traces_reply(scope.get("query_string", b"").decode("latin-1"))
        await send_json(send, status, body)


def _bounded_int(name: str, text: str, top: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidRequestError(f"{name} must be an integer, got {text!r}", param=name) from None
    if not 0 <= value <= top:
        raise InvalidRequestError(f"{name} must be between 0 and {top}, got {value}", param=name)
    return value


ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """The Anthropic Messages API's routes: their errors take Anthropic's shape."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def door_error(scope: Scope, error: DynamoError) -> HttpError:
    """A refusal at the doors in the shape of the route's API."""
    return to_anthropic_error(error) if is_anthropic_path(scope["path"]) else to_http_error(error)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    if is_anthropic_path(request.url.path):
        body = anthropic_error_body(exc.status_code, message)
    else:
        body = error_body(exc.status_code, message)
    return Response(body, status_code=exc.status_code, media_type="application/json")


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Whatever a Starlette-served route raised, through the same boundary as the hot endpoints."""
    error = to_http_error(exc, request_id=uuid.uuid4().hex)
    headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in error.headers}
    return Response(error.body, status_code=error.status, headers=headers, media_type="application/json")


def _route(path: str, endpoint: Any, methods: list[str]) -> Route:
    # An object (not a function) is served as a raw ASGI app by Starlette: no Request wrapper.
    return Route(path, endpoint, methods=methods)


class _AsgiFunction:
    """Wraps a bare ASGI function so Starlette serves it raw instead of as a request handler."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        await self._fn(scope, receive, send)


class FrontendApp:
    """The POST routes that generate or embed go straight to their endpoints; everything else
    through Starlette.

    Those carry nearly all the traffic, and each streamed chunk would otherwise pass through
    Starlette's two exception-handling ``send`` wrappers. The endpoints turn every failure into an
    OpenAI error body themselves, so the wrappers add nothing there.
    """

    def __init__(self, state: FrontendState, *, api_keys: bool = False) -> None:
        chat = ChatCompletionsEndpoint(state)
        completions = CompletionsEndpoint(state)
        store = ResponseStore(state.config.responses_store_size)
        self._hot = {
            "/v1/chat/completions": chat,
            "/v1/completions": completions,
            "/v1/embeddings": EmbeddingsEndpoint(state),
            "/v1/responses": ResponsesEndpoint(state, store),
            "/v1/messages": MessagesEndpoint(state),
        }
        self.starlette = _build_starlette(state, self._hot, store, api_keys=api_keys)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._hot.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.starlette(scope, receive, send)


def build_app(state: FrontendState, doors: DoorSettings | None = None) -> FrontDoors:
    """The routes behind their doors (``doors``: API keys, rate and body limits; None: defaults)."""
    doors = doors or DoorSettings()
    app = FrontendApp(state, api_keys=doors.api_keys is not None)
    return FrontDoors(app, state, doors, admission_paths=frozenset(app._hot), render_error=door_error)


def _build_starlette(state: FrontendState, hot: dict[str, Any], store: ResponseStore, *, api_keys: bool) -> Starlette:
    routes = [
        # The hot routes again, so that a wrong method on them gets Starlette's 405.
        *(_route(path, endpoint, ["POST"]) for path, endpoint in hot.items()),
        _route("/v1/models", ModelsEndpoint(state), ["GET"]),
        _route("/v1/models/{model_id:path}", ModelsEndpoint(state), ["GET"]),
        _route("/v1/responses/{response_id}", StoredResponsesEndpoint(store), ["GET", "DELETE"]),
        _route("/v1/messages/count_tokens", CountTokensEndpoint(state), ["POST"]),
        _route("/health", HealthEndpoint(state), ["GET"]),
        _route("/live", _AsgiFunction(live), ["GET"]),
        _route("/metrics", MetricsEndpoint(state), ["GET"]),
        _route("/v1/traces", TracesEndpoint(), ["GET"]),
        _route("/openapi.json", OpenApiEndpoint(state, api_keys=api_keys), ["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={404: _http_exception, 405: _http_exception, Exception: _unexpected},
    )
