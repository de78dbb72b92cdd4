"""Small ASGI helpers the endpoints share: read a bounded body, send JSON, watch for a client
that hangs up.

The endpoints speak ASGI directly instead of going through Starlette's ``Request`` and
``StreamingResponse``: those add an anyio task group and per-chunk wrapping to every streamed
request, which at hundreds of requests a second is a visible share of the frontend's CPU.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dynamod.daemon.frontend.http.errors import HttpError
from dynamod.shared.errors import DynamoError, InvalidRequestError

Scope = dict[str, Any]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
MAX_BODY_BYTES = 64 * 1024 * 1024


class BodyTooLargeError(DynamoError):
    code = "request_too_large"
    http_status = 413


async def read_body(receive: Any, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body, or ``InvalidRequestError`` if the client left or sent too much."""
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if message["type"] == "http.disconnect":
            raise InvalidRequestError("the client disconnected before sending the body")
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequestError("the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(f"the request body is over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def send_bytes(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Any, status: int, body: bytes, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = JSON_HEADERS if not extra_headers else [*JSON_HEADERS, *extra_headers]
    await send_bytes(send, status, body, headers)


async def send_error(send: Any, error: HttpError, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(send, error.status, error.body, [*error.headers, *(extra_headers or [])])


def header(scope: Scope, name: bytes) -> str | None:
    """A request header by lower-case name (ASGI servers lower-case them)."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class DisconnectWatch:
    """Cancels the request's task when the client hangs up, so the engine request is aborted.

    After the body has been read, the only message ``receive`` can still deliver is
    ``http.disconnect``; uvicorn also delivers it once the response is complete, so ``done()``
    must be called before the last send.
    """

    __slots__ = ("_task", "_watcher", "_done", "disconnected")

    def __init__(self, receive: Any) -> None:
        self._task = asyncio.current_task()
        self._done = False
        self.disconnected = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not self._done and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    def done(self) -> None:
        if not self._done:
            self._done = True
            self._watcher.cancel()

    def absorb_cancel(self) -> bool:
        """In an ``except CancelledError``: True (and the cancel undone) if it was our hang-up."""
        if self.disconnected and self._task is not None:
            self._task.uncancel()
            return True
        return False
