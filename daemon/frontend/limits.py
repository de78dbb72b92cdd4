"""Limits the frontend applies before it does any work for a request: a per-client request rate
and a cap on the request body.

Rate: one token bucket per client (its API key when keys are on, else its address), ``rate``
tokens a second up to ``burst``; a request takes one token or is refused with how long until the
next one (sent as ``Retry-After``). The table of buckets is bounded: past ``max_clients`` the
buckets that have refilled (idle clients, indistinguishable from new ones) are dropped first, so a
scan from many addresses costs memory only up to the bound.

Body: a declared ``Content-Length`` over the cap is refused before a byte of the body is read; a
chunked body is counted as it arrives and refused the moment it passes the cap.
"""

from __future__ import annotations

import time
from typing import Any

from dynamod.daemon.frontend.asgi import BodyTooLargeError
from dynamod.shared.errors import ConfigError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""A 128k-token prompt is well under 1 MiB of JSON; a few images in base64 fit too."""

DEFAULT_MAX_CLIENTS = 65536


class RateLimiter:
    """Token buckets per client key (see the module docstring)."""

    __slots__ = ("rate", "burst", "max_clients", "_buckets")

    def __init__(self, rate: float, burst: float | None = None, *, max_clients: int = DEFAULT_MAX_CLIENTS) -> None:
        if rate <= 0:
            raise ConfigError(f"--rate-limit must be above 0 requests/s to limit anything, got {rate}")
        burst = max(1.0, rate) if burst is None or burst <= 0 else burst
        if burst < 1:
            raise ConfigError(f"--rate-limit-burst must be at least 1 request, got {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_clients = max_clients
        self._buckets: dict[str, list[float]] = {}  # client -> [tokens, at]

    def acquire(self, client: str, now: float | None = None) -> float:
        """0.0 when ``client`` may go ahead (a token is taken), else the seconds until it may."""
        if now is None:
            now = time.monotonic()
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= self.max_clients:
                self._evict(now)
            self._buckets[client] = [self.burst - 1.0, now]
            return 0.0
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            return 0.0
        bucket[0] = tokens
        return (1.0 - tokens) / self.rate

    def _evict(self, now: float) -> None:
        full_after = self.burst / self.rate
        self._buckets = {k: b for k, b in self._buckets.items() if now - b[1] < full_after}
        if len(self._buckets) >= self.max_clients:
            # Every client is active: keep the newer half (dicts keep insertion order).
            keep = list(self._buckets.items())[self.max_clients // 2 :]
            self._buckets = dict(keep)

    def __len__(self) -> int:
        return len(self._buckets)


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's ``Content-Length`` (None when absent: a chunked body, or none)."""
    for key, value in headers:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request before the app sees it
    return None


def too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"the request body is larger than this frontend accepts ({limit} bytes)")


def capped_receive(receive: Any, limit: int) -> Any:
    """``receive`` that raises ``BodyTooLargeError`` once the body read so far passes ``limit``
    (for bodies without a declared length; the endpoint's error boundary answers 413)."""
    seen = 0

    async def _receive() -> Any:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(limit)
        return message

    return _receive
