"""The doors and ``x-request-id``/``/v1/traces``, without processes: the id is made or checked
before anything else and echoed on every answer (refusals included); ``/v1/traces`` takes an API
key or, like ``/metrics``, the cluster token."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from dynamod.daemon.frontend.http.auth import ApiKeys
from dynamod.daemon.frontend.http.request_checks import DoorSettings, FrontDoors
from dynamod.daemon.frontend.http.request_id import request_id_of
from dynamod.shared.security.token import ClusterToken

KEY = "k" * 20
TOKEN = "t" * 32


class _State:
    def __init__(self) -> None:
        self.metrics = type("M", (), {"registry": CollectorRegistry()})()

    def admission_refusal(self, cost: int = 1) -> None:
        return None


async def _app(scope: dict, receive: Any, send: Any) -> None:
    body = (request_id_of(scope) or "").encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


async def _call(doors: FrontDoors, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": headers, "client": ("127.0.0.1", 5)}
    await doors(scope, receive, send)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


async def test_request_id_made_checked_and_echoed() -> None:
    doors = FrontDoors(_app, _State(), DoorSettings(), admission_paths=frozenset())
    status, headers, body = await _call(doors, "/v1/models", [(b"x-request-id", b"abc-123")])
    assert status == 200 and headers[b"x-request-id"] == b"abc-123" and body == b"abc-123"
    status, headers, body = await _call(doors, "/v1/models", [])
    assert status == 200 and len(headers[b"x-request-id"]) == 32 and body == headers[b"x-request-id"]
    status, headers, body = await _call(doors, "/v1/models", [(b"x-request-id", b"bad id\x01")])
    assert status == 400 and b"x-request-id" in body and b"x-request-id" not in headers


async def test_traces_take_an_api_key_or_the_cluster_token() -> None:
    settings = DoorSettings(api_keys=ApiKeys([KEY]), member_token=ClusterToken(TOKEN))
    doors = FrontDoors(_app, _State(), settings, admission_paths=frozenset())
    rid = (b"x-request-id", b"q1")
    status, headers, _ = await _call(doors, "/v1/traces", [rid])
    assert status == 401 and headers[b"x-request-id"] == b"q1"  # refusals echo the id too
    assert (await _call(doors, "/v1/traces", [(b"authorization", f"Bearer {KEY}".encode())]))[0] == 200
    assert (await _call(doors, "/v1/traces", [(b"authorization", f"Bearer {TOKEN}".encode())]))[0] == 200
    # The cluster token opens /metrics and /v1/traces, not the API.
    assert (await _call(doors, "/v1/models", [(b"authorization", f"Bearer {TOKEN}".encode())]))[0] == 401
