"""The request plane's narrow interface: a server that hosts endpoint handlers and a client that
opens request streams to an instance. Two transports implement it: TCP (default) and NATS.

A request is ``(endpoint, headers, body)``; the response is a stream of bodies ended by an end frame
or by an error frame. Bodies are any msgpack-encodable value (dicts, lists, msgspec Structs);
handlers receive the decoded body (plain Python objects) and a ``RequestContext``.

Cancellation: when the client stops reading (closes its iterator or its task is cancelled) a cancel
frame is sent and the handler's async generator is closed (``aclose``), so ``finally`` blocks in
engines run and the engine request is aborted.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

DEFAULT_MAX_FRAME_BYTES = 32 * 1024 * 1024  # a 1M-token prompt as msgpack u32 fits with room


@dataclass(slots=True)
class RequestContext:
    """What a handler knows about the request besides its body."""

    request_id: str
    endpoint: str
    headers: dict[str, str] = field(default_factory=dict)
    deadline: float | None = None  # time.monotonic() deadline, None for none

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


Handler = Callable[[Any, RequestContext], AsyncIterator[Any]]
"""An async generator function: ``async def handler(body, ctx): yield ...``."""


@dataclass(frozen=True, slots=True)
class ServerAddress:
    transport: str  # "tcp" | "nats"
    address: str  # "host:port" for tcp, base subject for nats


@runtime_checkable
class RequestPlaneServer(Protocol):
    """Hosts handlers for endpoints of this process on one listening address."""

    async def start(self) -> ServerAddress: ...

    def register(self, endpoint_path: str, handler: Handler) -> None:
        """``endpoint_path`` identifies a served endpoint within this server, e.g.
        ``dynamo/backend/generate/1a2b`` (namespace/component/endpoint/instance id hex)."""
        ...

    def unregister(self, endpoint_path: str) -> None: ...

    @property
    def inflight(self) -> int:
        """Streams currently being served."""
        ...

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stops accepting new streams, waits up to ``grace_s`` for in-flight ones, then cancels."""
        ...


@runtime_checkable
class RequestPlaneClient(Protocol):
    """Opens request streams. One client per process; it multiplexes streams on shared connections."""

    def stream(
        self,
        address: ServerAddress,
        endpoint_path: str,
        body: Any,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Any]:
        """Sends one request and yields the decoded response bodies in order.

        Raises (from iteration): TransportError when the connection is refused or lost before the
        end frame (the caller may migrate), DeadlineExceededError, FrameTooLargeError for a body
        over the limit, or the error the handler raised (errors.error_from_wire).
        """
        ...

    async def close(self) -> None: ...


ConnectHook = Callable[[ServerAddress], Awaitable[None]]
