"""Recorded trace payloads served as a cluster would serve them, for the gathering, dynamoctl and
console tests: frontends answering ``GET /v1/traces`` (an ``httpx.MockTransport``) and workers
answering the ``traces`` control endpoint (a stand-in for ``ControlClient`` listing and calling
them). Both filter the recorded spans the way the contract says a process does: by request id (the
spans tagged with it) or by trace id (every span of the trace), at most ``limit``.

The recording (``fixtures/trace_disagg.json``): one disaggregated request that migrated from one
decode worker to another (frontend, prefill worker, two decode workers; the KV-transfer spans carry
no request id, so only the trace-id round finds them), and two frontends' ``?slowest=N`` lists.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from dynamod.console.actions.traces import TRACES_ENDPOINT, TraceGatherer
from dynamod.console.collectors.scraper import Credential, FrontendHttp
from dynamod.shared.errors import RemoteError
from dynamod.shared.protocol.instance import Instance

FIXTURE = Path(__file__).parent / "fixtures" / "trace_disagg.json"


def load() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def select(spans: Iterable[dict[str, Any]], request_id: str | None, trace_id: str | None, limit: int = 1000) -> list[dict[str, Any]]:
    if trace_id:
        out = [s for s in spans if s["trace_id"] == trace_id]
    else:
        out = [s for s in spans if s["attributes"].get("request_id") == request_id]
    return out[:limit]


class FakeFrontends:
    """``/v1/traces`` of frontends at the given URLs, each holding the given spans; a key, when
    set, is required as the bearer token (as a frontend with API keys requires it)."""

    def __init__(self, spans_by_url: dict[str, list[dict[str, Any]]], slowest: dict[str, list[dict[str, Any]]] | None = None,
                 *, key: str | None = None, down: Iterable[str] = ()) -> None:
        self.spans_by_url = spans_by_url
        self.slowest = slowest or {}
        self.key = key
        self.down = set(down)
        self.asked: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url.copy_with(query=None))
        self.asked.append(str(request.url))
        if url in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": {"message": "missing API key"}})
        if url not in self.spans_by_url and url not in self.slowest:
            return httpx.Response(404, json={"error": {"message": "not found"}})
        params = request.url.params
        if "slowest" in params:
            rows = self.slowest.get(url, [])[: int(params["slowest"])]
            return httpx.Response(200, json={"object": "list", "requests": rows})
        data = select(self.spans_by_url.get(url, []), params.get("request_id"), params.get("trace_id"))
        return httpx.Response(200, json={"object": "list", "data": data})

    def http(self, credentials: list[Credential] | None = None) -> FrontendHttp:
        creds = credentials or [Credential("", {})]
        return FrontendHttp(creds, transport=httpx.MockTransport(self.handler))


def worker_record(hex_id: str, endpoint: str, component: str = "backend") -> Instance:
    return Instance(namespace="dynamo", component=component, endpoint=endpoint, instance_id=int(hex_id, 16),
                    transport="tcp", address="127.0.0.1:1", role=component)


class FakeWorkers:
    """The ``ControlClient`` surface the gatherer uses: the instances discovery lists, and the
    ``traces`` replies. ``silent`` workers never answer; ``old`` ones serve no ``traces``."""

    def __init__(self, spans_by_worker: dict[str, list[dict[str, Any]]], *, silent: Iterable[str] = (),
                 failing: Iterable[str] = (), old: Iterable[str] = ()) -> None:
        self.spans_by_worker = spans_by_worker
        self.silent = set(silent)
        self.failing = set(failing)
        self.old = list(old)
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    async def instances(self) -> list[Instance]:
        out = []
        for hex_id in [*self.spans_by_worker, *self.old]:
            out.append(worker_record(hex_id, "generate"))
            if hex_id not in self.old:
                out.append(worker_record(hex_id, TRACES_ENDPOINT))
        out.append(Instance(namespace="dynamo", component="frontend", endpoint="http", instance_id=0xF0,
                            transport="http", address="127.0.0.1:8000", role="frontend"))
        return out

    async def call_instance(self, rec: Instance, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        hex_id = f"{rec.instance_id:016x}"
        self.bodies.append((hex_id, body))
        if hex_id in self.silent:
            await asyncio.sleep(timeout_s + 5)
        if hex_id in self.failing:
            raise RemoteError("handler failed: ring buffer locked")
        spans = select(self.spans_by_worker.get(hex_id, []), body.get("request_id"), body.get("trace_id"), body["limit"])
        return {"status": "ok", "message": f"{len(spans)} spans", "spans": spans}


FRONTEND_URL = "http://127.0.0.1:8000/v1/traces"
SECOND_FRONTEND_URL = "http://127.0.0.1:8001/v1/traces"


def recorded_gatherer(fixture: dict[str, Any] | None = None, **workers_kw: Any) -> tuple[TraceGatherer, FakeFrontends, FakeWorkers]:
    """A real ``TraceGatherer`` over the recorded cluster: one frontend with the frontend spans,
    the workers with theirs."""
    fx = fixture or load()
    frontends = FakeFrontends({FRONTEND_URL: fx["frontend"]}, fx["slowest"])
    workers = FakeWorkers(fx["workers"], **workers_kw)
    gatherer = TraceGatherer(workers, lambda: [FRONTEND_URL], frontends.http(), worker_timeout_s=0.2)  # type: ignore[arg-type]
    return gatherer, frontends, workers
