"""Limits the frontend applies before it does any work for a request: a per-client request rate
and a cap on the request body.

Rate: one token bucket per client (its API key when keys are on, else its address), ``rate``
tokens a second up to ``burst``; a request takes one token or is refused with how long until the
next one (sent as ``Retry-After``). A request that starts several generations (prompts x ``n``,
``fanout.check_fanout``) takes one token per generation; one costing more than the burst may go
ahead once the bucket is full and leaves it in debt, so its cost is still paid at ``rate``
(``shared/security/rate_limit``: the buckets, bounded in number).

Body: a declared ``Content-Length`` over the cap is refused before a byte of the body is read; a
chunked body is counted as it arrives and refused the moment it passes the cap.
"""

from __future__ import annotations

from typing import Any

from dynamod.daemon.frontend.http.asgi import BodyTooLargeError
from dynamod.shared.errors import RateLimitedError

# The buckets live in shared/security (status servers limit failed auth with them too).
from dynamod.shared.security.rate_limit import (  # noqa: F401 - re-exported
    DEFAULT_AUTH_FAILURE_BURST,
    DEFAULT_AUTH_FAILURE_RATE,
    DEFAULT_MAX_CLIENTS,
    RateLimiter,
)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""A 128k-token prompt is well under 1 MiB of JSON; a few images in base64 fit too."""

RATE_LIMIT_SCOPE_KEY = "dynamod.rate_limit"
"""Scope key the doors set to (limiter, client) when they charged a request, so an endpoint can
charge the rest of its cost to the same bucket."""


def rate_limited_error(limiter: RateLimiter, wait: float, cost: float = 1.0) -> RateLimitedError:
    what = f"; this request costs {cost:g} (prompts x n)" if cost > 1 else ""
    return RateLimitedError(
        f"Rate limit reached: {limiter.rate:g} requests/s with bursts of {limiter.burst:g}{what}; retry in {wait:.2f}s.",
        retry_after_s=wait,
    )


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
