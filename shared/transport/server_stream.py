"""The server side of request streams, shared by the TCP and NATS request planes.

``ServerStream.run`` drives one handler's async generator: each yielded body waits for send credit
(the client's window) and is written by the transport; the end or the error closes the stream. A
cancel from the client, the request's deadline or a forced server stop cancels the task, and the
generator is always closed (``aclose``) so the handler's ``finally`` runs and the engine request is
aborted.

``ServingState`` is the bookkeeping both servers share: the handler table, the in-flight streams
and the two-stage stop (stop accepting, wait up to a grace period, then cancel the rest).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from dynamod.shared.errors import (
    DeadlineExceededError,
    DynamoError,
    NotFoundError,
    TransportError,
    UnavailableError,
    error_to_wire,
)
from dynamod.shared.transport.plane import Handler, RequestContext, ServerAddress

logger = logging.getLogger(__name__)

_CANCEL_WAIT_S = 5.0  # how long stop() waits for cancelled handlers to run their finally blocks


class ServerStream(ABC):
    """One request being served. Subclasses write frames for their transport.

    ``_write_*`` may return ``None`` (written synchronously into a buffer, the TCP case) or an
    awaitable (an async publish, the NATS case); ``run`` awaits only in the second case so the TCP
    hot path does not create a coroutine per frame.
    """

    __slots__ = (
        "_credit_waiter",
        "_deadline_handle",
        "_on_done",
        "_state",
        "cancel_reason",
        "credit",
        "ctx",
        "task",
    )

    def __init__(self, ctx: RequestContext, credit: int) -> None:
        self.ctx = ctx
        self.credit = credit
        self.cancel_reason: DynamoError | None = None
        self.task: asyncio.Task[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        self._state: ServingState | None = None
        self._on_done: Callable[[ServerStream], None] | None = None
        self._deadline_handle: asyncio.TimerHandle | None = None

    @abstractmethod
    def _write_data(self, item: Any) -> Awaitable[None] | None: ...

    @abstractmethod
    def _write_end(self) -> Awaitable[None] | None: ...

    @abstractmethod
    def _write_error(self, err: dict[str, Any]) -> Awaitable[None] | None: ...

    def _peer_gone(self) -> bool:
        """True when the transport to the client is closed (a write failed for that reason)."""
        return False

    def _blocked(self) -> bool:
        """True when the stream may not send now: no credit, or the transport asked to pause."""
        return self.credit <= 0

    def add_credit(self, frames: int) -> None:
        self.credit += frames
        self.wake()

    def wake(self) -> None:
        """Re-checks a stream waiting to send (credit arrived or the transport resumed)."""
        waiter = self._credit_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel(self, reason: DynamoError | None) -> None:
        """Cancels the handler. ``reason`` is sent to the client as the stream's error; ``None``
        when the client itself cancelled (nobody is listening any more)."""
        task = self.task
        # Once only: a second cancel would interrupt the handler's finally block while it aborts.
        if task is not None and not task.done() and not task.cancelling():
            self.cancel_reason = reason
            task.cancel()

    async def _wait_sendable(self) -> None:
        loop = asyncio.get_running_loop()
        while self._blocked():
            waiter = loop.create_future()
            self._credit_waiter = waiter
            try:
                await waiter
            finally:
                self._credit_waiter = None

    async def run(self, handler: Handler, body: Any) -> None:
        agen: Any = None
        try:
            agen = handler(body, self.ctx)
            anext_ = getattr(agen, "__anext__", None)
            if anext_ is None:
                if hasattr(agen, "close"):
                    agen.close()  # a coroutine: close it so it is not reported as never awaited
                agen = None
                raise TypeError(f"the handler of {self.ctx.endpoint!r} must be an async generator function")
            while True:
                try:
                    item = await anext_()
                except StopAsyncIteration:
                    break
                if self._blocked():
                    await self._wait_sendable()
                self.credit -= 1
                pending = self._write_data(item)
                if pending is not None:
                    await pending
            pending = self._write_end()
            if pending is not None:
                await pending
        except asyncio.CancelledError:
            reason = self.cancel_reason
            task = self.task
            if reason is None and task is not None and not task.cancelling():
                # Nobody cancelled this stream: the handler let a CancelledError of its own escape.
                # The client is still waiting, so it must hear that the stream is over.
                logger.warning(
                    "request_plane.handler_cancelled_itself endpoint=%s request_id=%s",
                    self.ctx.endpoint,
                    self.ctx.request_id,
                )
                await self._send_error_quietly(
                    error_to_wire(DynamoError("the request handler was cancelled"))
                )
            elif reason is not None:
                logger.info(
                    "request_plane.stream_cancelled endpoint=%s request_id=%s reason=%s",
                    self.ctx.endpoint,
                    self.ctx.request_id,
                    reason.code,
                )
                await self._send_error_quietly(error_to_wire(reason))
        except Exception as exc:  # noqa: BLE001 - any handler failure becomes the stream's error frame
            if isinstance(exc, TransportError) and self._peer_gone():
                # Our own connection went away under the stream: nobody is left to tell.
                logger.debug(
                    "request_plane.stream_peer_gone request_id=%s reason=%s", self.ctx.request_id, exc
                )
                return
            if isinstance(exc, DynamoError):
                logger.info(
                    "request_plane.handler_error endpoint=%s request_id=%s code=%s message=%s",
                    self.ctx.endpoint,
                    self.ctx.request_id,
                    exc.code,
                    exc,
                )
            else:
                logger.exception(
                    "request_plane.handler_failed endpoint=%s request_id=%s",
                    self.ctx.endpoint,
                    self.ctx.request_id,
                )
            await self._send_error_quietly(error_to_wire(exc))
        finally:
            if agen is not None:
                await _close_generator(agen, self.ctx)

    def _task_done(self, _: asyncio.Task[None]) -> None:
        state = self._state
        if state is not None:
            state._streams.discard(self)
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None
        if self._on_done is not None:
            self._on_done(self)

    async def _send_error_quietly(self, err: dict[str, Any]) -> None:
        try:
            pending = self._write_error(err)
            if pending is not None:
                await pending
        except Exception as exc:  # noqa: BLE001 - the peer may be gone; the stream is over either way
            logger.debug(
                "request_plane.error_frame_not_sent request_id=%s reason=%s", self.ctx.request_id, exc
            )


async def _close_generator(agen: Any, ctx: RequestContext) -> None:
    aclose = getattr(agen, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a failing finally block must not take the server down
        logger.exception(
            "request_plane.handler_close_failed endpoint=%s request_id=%s", ctx.endpoint, ctx.request_id
        )


class ServesFromState:
    """The members a request-plane server (TCP, NATS) answers from its ``ServingState`` and its
    address; the server sets both in its constructor."""

    _state: ServingState
    _address: ServerAddress | None

    @property
    def address(self) -> ServerAddress | None:
        """Where clients reach this server; None until ``start()``."""
        return self._address

    def register(self, endpoint_path: str, handler: Handler) -> None:
        self._state.register(endpoint_path, handler)

    def unregister(self, endpoint_path: str) -> None:
        self._state.unregister(endpoint_path)

    @property
    def inflight(self) -> int:
        return self._state.inflight

    @property
    def stopping(self) -> bool:
        """True once ``stop()`` began: new requests are refused with UnavailableError."""
        return self._state.stopping


class ServingState:
    """Handler table, in-flight streams and the two-stage stop, for one request-plane server."""

    __slots__ = ("_handlers", "_streams", "stopping")

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._streams: set[ServerStream] = set()
        self.stopping = False

    def register(self, endpoint_path: str, handler: Handler) -> None:
        self._handlers[endpoint_path] = handler

    def unregister(self, endpoint_path: str) -> None:
        self._handlers.pop(endpoint_path, None)

    def handler_for(self, endpoint_path: str) -> Handler:
        """The handler to run, or the error to answer with."""
        if self.stopping:
            raise UnavailableError("server is stopping; retry on another instance")
        handler = self._handlers.get(endpoint_path)
        if handler is None:
            raise NotFoundError(f"no handler for endpoint {endpoint_path!r} on this server")
        return handler

    @property
    def inflight(self) -> int:
        return len(self._streams)

    def start(
        self,
        stream: ServerStream,
        handler: Handler,
        body: Any,
        on_done: Callable[[ServerStream], None] | None = None,
    ) -> None:
        """Runs the stream in its own task; ``on_done(stream)`` runs when the task ends, even if it
        was cancelled before its first step."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(stream.run(handler, body))
        stream.task = task
        stream._state = self
        stream._on_done = on_done
        self._streams.add(stream)
        timeout = stream.ctx.time_left()
        if timeout is not None:
            stream._deadline_handle = loop.call_later(
                max(0.0, timeout),
                stream.cancel,
                DeadlineExceededError(
                    f"deadline of the request {stream.ctx.request_id} exceeded on the server"
                ),
            )
        task.add_done_callback(stream._task_done)

    def cancel_all(self, reason: DynamoError | None) -> None:
        for stream in list(self._streams):
            stream.cancel(reason)

    async def drain(self, grace_s: float) -> int:
        """Waits up to ``grace_s`` for in-flight streams, then cancels the rest with
        UnavailableError. Returns how many had to be cancelled."""
        self.stopping = True
        tasks = {s.task for s in self._streams if s.task is not None}
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        left = [s for s in self._streams if s.task is not None and not s.task.done()]
        for stream in left:
            stream.cancel(
                UnavailableError("server stopped before the stream finished; retry on another instance")
            )
        remaining = {s.task for s in left if s.task is not None}
        if remaining:
            _, pending = await asyncio.wait(remaining, timeout=_CANCEL_WAIT_S)
            if pending:
                logger.warning("request_plane.stop_handlers_stuck count=%d", len(pending))
        return len(left)
