"""Anthropic-shaped errors: ``{"type": "error", "error": {"type", "message"}, "request_id"}``.

The failure is described once by the frontend's boundary (``http/errors.describe_error``: the
status from the exception's class, the message, ``Retry-After``); this module only names it the way
Anthropic's API does, so the official client raises its typed errors (``BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ``RateLimitError``, ...). The status stays ours: a
draining or saturated frontend answers 503 (``overloaded_error``), which load balancers and
Anthropic's client both treat as retryable, where Anthropic's own API says 529.
"""

from __future__ import annotations

from dynamod.daemon.frontend.anthropic.schema import ErrorBody, ErrorDetail, encoder
from dynamod.daemon.frontend.http.errors import HttpError, describe_error

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
REQUEST_ID_PREFIX = "req_"


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (``api_error`` for any other server error)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str, request_id: str | None = None) -> bytes:
    return encoder.encode(ErrorBody(error=ErrorDetail(type=error_type(status), message=message), request_id=request_id))


def describe(exc: BaseException, request_id: str = "") -> tuple[int, str, list[tuple[bytes, bytes]]]:
    """(status, message, headers) for ``exc``: the boundary's description, with the parameter in
    the message (Anthropic's errors have no ``param`` field)."""
    info = describe_error(exc, request_id=request_id)
    message = info.message
    if info.param and info.param not in message:
        message = f"{info.param}: {message}"
    return info.status, message, info.headers


def to_anthropic_error(exc: BaseException, *, request_id: str = "") -> HttpError:
    """The response for ``exc`` in Anthropic's shape (bugs are logged, never shown)."""
    status, message, headers = describe(exc, request_id)
    rid = REQUEST_ID_PREFIX + request_id if request_id else None
    if rid is not None:
        headers = [*headers, (b"request-id", rid.encode())]
    return HttpError(status, anthropic_error_body(status, message, rid), headers)
