"""The client side of one request stream, shared by the TCP and NATS request planes.

The transport pushes what arrives (``push_data``, ``push_end``, ``push_error``) from its receive
callback; the caller pulls with ``async for``. The buffer holds at most the stream's window of
data frames because the server sends only what the reader has granted: the stream grants more
credit each time its reader has consumed half a window.

Leaving early (``aclose``, ``break`` followed by garbage collection, or the caller's task being
cancelled while it waits) sends a cancel to the server, which closes the handler's generator.
A deadline (``timeout_s``) raises DeadlineExceededError and cancels the server side as well.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Generic, TypeVar

from dynamod.shared.errors import DeadlineExceededError
from dynamod.shared.observability.tracing import outgoing_headers
from dynamod.shared.transport.plane import ServerAddress

logger = logging.getLogger(__name__)


class ClientStream(ABC):
    """Async iterator over one request's response bodies. Subclasses connect and send frames."""

    __slots__ = (
        "__weakref__",
        "_body",
        "_client",
        "_deadline_handle",
        "_done",
        "_endpoint",
        "_error",
        "_finished",
        "_grant_at",
        "_headers",
        "_items",
        "_loop",
        "_opened",
        "_request_id",
        "_sid",
        "_unacked",
        "_waiter",
        "address",
        "timeout_s",
        "window",
    )

    def __init__(
        self,
        client: Any,
        address: ServerAddress,
        endpoint_path: str,
        body: Any,
        headers: dict[str, str] | None,
        timeout_s: float | None,
        request_id: str | None,
        window: int,
    ) -> None:
        self._client = client  # the transport's client that opened this stream
        # The request, kept until the transport sends it (which drops the body).
        self.address = address
        self._endpoint = endpoint_path
        self._body = body
        self._headers = headers
        self._request_id = request_id
        self._sid = 0  # the transport's stream id, once opened
        self.window = window
        self.timeout_s = timeout_s
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False  # the transport delivered end or error: nothing more will be pushed
        self._error: BaseException | None = None
        self._finished = False  # the reader saw the end, or left: iteration is over
        self._opened = False
        self._unacked = 0
        self._grant_at = max(1, window // 2)
        self._deadline_handle: asyncio.TimerHandle | None = None

    # -- what the transport implements --------------------------------------------------------

    @abstractmethod
    async def _open(self) -> None:
        """Connects if needed, registers the stream for incoming frames and sends the request."""

    @abstractmethod
    def _send_grant(self, frames: int) -> None:
        """Tells the server the reader consumed ``frames`` more data frames."""

    @abstractmethod
    def _send_cancel(self) -> None:
        """Tells the server to stop the handler, and stops routing frames to this stream."""

    # -- called by the transport ------------------------------------------------------------

    def push_data(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def push_end(self) -> None:
        self._done = True
        self._wake()

    def push_error(self, exc: BaseException) -> None:
        if self._done:
            return
        self._done = True
        self._error = exc
        self._wake()

    def fail(self, exc: BaseException) -> bool:
        """Ends the stream with ``exc`` from outside the transport (its instance left discovery):
        the server is told to stop, if it still listens, and the reader raises ``exc`` now. A
        stream not sent yet never will be. Returns False when the stream had already ended."""
        if self._done or self._finished:
            return False
        if self._opened:
            self._send_cancel()
        else:
            self._opened = True  # nothing to send any more: the first read raises ``exc``
        self.push_error(exc)
        return True

    @property
    def buffered(self) -> int:
        """Response bodies received and not yet read."""
        return len(self._items)

    @property
    def is_open(self) -> bool:
        """Sent and still expecting frames from the server."""
        return self._opened and not self._done and not self._finished

    # -- the iterator -----------------------------------------------------------------------

    def __aiter__(self) -> ClientStream:
        return self

    async def __anext__(self) -> Any:
        items = self._items
        if items:
            item = items.popleft()
            self._unacked += 1
            if self._unacked >= self._grant_at and not self._done:
                self._send_grant(self._unacked)
                self._unacked = 0
            return item
        return await self._next_slow()

    async def _next_slow(self) -> Any:
        if self._finished:
            raise StopAsyncIteration
        if not self._opened:
            await self._open_with_deadline()
        if self._waiter is not None:
            raise RuntimeError("a response stream is read by one task at a time")
        items = self._items
        while not items:
            if self._done:
                self._finish()
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            loop = self._loop or asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiter = waiter
            try:
                await waiter
            except asyncio.CancelledError:
                self._abandon()
                raise
            finally:
                self._waiter = None
        return await self.__anext__()

    async def _open_with_deadline(self) -> None:
        self._opened = True
        self._loop = asyncio.get_running_loop()
        timeout = self.timeout_s
        try:
            if timeout is None:
                await self._open()
                if self._done:  # failed while connecting: the request went out, call it back
                    self._send_cancel()
            else:
                if timeout <= 0:
                    raise DeadlineExceededError(
                        f"deadline of {timeout}s exceeded before the request was sent"
                    )
                start = self._loop.time()
                try:
                    async with asyncio.timeout(timeout):
                        await self._open()
                except TimeoutError as exc:
                    raise DeadlineExceededError(f"deadline of {timeout}s exceeded while connecting") from exc
                remaining = timeout - (self._loop.time() - start)
                if self._done:  # failed while connecting: the request went out, call it back
                    self._send_cancel()
                    return
                # A weak reference, so a stream its reader dropped is collected (and cancelled) now,
                # not when its deadline fires.
                self._deadline_handle = self._loop.call_later(
                    max(0.0, remaining), _deadline_fired, weakref.ref(self)
                )
        except BaseException:
            self._done = True
            self._finish()
            raise

    def _on_deadline(self) -> None:
        self._deadline_handle = None
        if self._done or self._finished:
            return
        self._send_cancel()
        self.push_error(DeadlineExceededError(f"deadline of {self.timeout_s}s exceeded"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self) -> None:
        self._finished = True
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None

    def _abandon(self) -> None:
        """The reader left before the end: cancel the server side, drop what is buffered."""
        if self._finished:
            return
        if self._opened and not self._done:
            self._done = True
            self._send_cancel()
        self._items.clear()
        self._finish()

    async def aclose(self) -> None:
        """Stops reading; the server's handler is cancelled if it had not finished."""
        self._abandon()

    async def __aenter__(self) -> ClientStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._abandon()

    def __del__(self) -> None:
        # A reader that breaks out of ``async for`` without aclose() still frees the server side.
        if self._finished or not self._opened or self._done:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                self._abandon()
            else:
                loop.call_soon_threadsafe(self._abandon)
        except RuntimeError:
            logger.debug("request_plane.stream_gc_cancel_skipped reason=loop_closed")


S = TypeVar("S", bound=ClientStream)


class StreamingClient(Generic[S]):
    """``stream()`` of a request-plane client (the ``RequestPlaneClient`` protocol): one
    ``stream_class`` object per request, with the client's flow-control window."""

    stream_class: type[S]
    window_frames: int

    def stream(
        self,
        address: ServerAddress,
        endpoint_path: str,
        body: Any,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> S:
        # The current trace span (if any) rides in the frame headers: ``traceparent`` and
        # ``x-request-id``, read when the stream is made, since it is sent later.
        headers = outgoing_headers(headers)
        return self.stream_class(self, address, endpoint_path, body, headers, timeout_s, request_id, self.window_frames)


def _deadline_fired(ref: weakref.ref[ClientStream]) -> None:
    stream = ref()
    if stream is not None:
        stream._on_deadline()
