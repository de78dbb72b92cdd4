"""Maps exceptions to OpenAI-shaped error bodies with the right HTTP status.

The body is always ``{"error": {"message", "type", "param", "code"}}``, which the official client
turns into ``BadRequestError``, ``NotFoundError``, ``InternalServerError`` and so on. Only an
exception outside the ``DynamoError`` tree is a bug: it is logged with its traceback and the client
gets a 500 with the request id, never the traceback itself.
"""

from __future__ import annotations

import logging

from dynamod.daemon.frontend.protocol import ErrorBody, ErrorDetail, encoder
from dynamod.shared.errors import (
    DynamoError,
    InvalidRequestError,
    NoInstancesError,
    NotFoundError,
    OverloadedError,
    RemoteError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}

DEFAULT_RETRY_AFTER_S = 1


class HttpError:
    """An error ready to send: status, encoded body and extra headers."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.body = body
        self.headers = headers


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> bytes:
    detail = ErrorDetail(message=message, type=_TYPE_BY_STATUS.get(status, "error"), param=param, code=code)
    return encoder.encode(ErrorBody(error=detail))


def to_http_error(exc: BaseException, *, request_id: str = "") -> HttpError:
    """The response for ``exc``; logs bugs with their traceback."""
    headers: list[tuple[bytes, bytes]] = []
    param: str | None = None
    if isinstance(exc, NotFoundError):
        status, code, message = 404, exc.code if exc.code != "not_found" else "model_not_found", exc.message
    elif isinstance(exc, InvalidRequestError):
        status, code, message, param = 400, exc.code, exc.message, exc.param
    elif isinstance(exc, OverloadedError):
        status, code, message = 503, exc.code, exc.message
        headers.append((b"retry-after", str(max(1, round(exc.retry_after_s))).encode()))
    elif isinstance(exc, UnavailableError | NoInstancesError):
        status, code, message = 503, exc.code, exc.message
        headers.append((b"retry-after", str(DEFAULT_RETRY_AFTER_S).encode()))
    elif isinstance(exc, RemoteError):
        status, code, message = exc.http_status, exc.remote_code, exc.message
        if status == 503:
            headers.append((b"retry-after", str(DEFAULT_RETRY_AFTER_S).encode()))
    elif isinstance(exc, DynamoError):
        status, code, message = exc.http_status, exc.code, exc.message or str(exc)
        if status == 503:
            headers.append((b"retry-after", str(DEFAULT_RETRY_AFTER_S).encode()))
    else:
        logger.error("request failed with a bug request_id=%s error=%s", request_id, type(exc).__name__, exc_info=exc)
        status, code = 500, "internal_error"
        message = f"internal error; the frontend log has the details under request_id={request_id}"
    return HttpError(status, error_body(status, message, code=code, param=param), headers)
