"""The frontend's error boundary: any exception -> an OpenAI-shaped error body with the right status.

The body is always ``{"error": {"message", "type", "param", "code"}}``, which the official client
turns into ``BadRequestError``, ``NotFoundError``, ``InternalServerError`` and so on.

The mapping is done once, here, and read from the class (httpx's ``map_httpcore_exceptions`` is
the model): a ``DynamoError`` brings its own ``http_status``, ``public_code``, ``param`` and
``retry_after_s`` (``shared/errors.py`` is the one source of statuses). A foreign exception that
reaches a handler (msgspec rejecting a body, bytes that are not UTF-8, a library's ``ValueError``,
a timeout, a dropped connection) is first translated to the ``DynamoError`` class that names what
went wrong, by the most specific entry of ``FOREIGN_ERRORS`` in its MRO. Anything else is a bug:
it is logged with its traceback and the client gets a 500 with the request id, never the traceback.
"""

from __future__ import annotations

import logging
import math

import msgspec

from dynamod.shared.errors import (
    DeadlineExceededError,
    DynamoError,
    InvalidRequestError,
    NotFoundError,
    TransportError,
)

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's type for a missing or wrong API key (code invalid_api_key)
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}

# OpenAI's name for an unknown model; inside dynamod (and on the wire) it stays ``not_found``.
_OPENAI_CODES = {NotFoundError.code: "model_not_found"}

FOREIGN_ERRORS: dict[type[BaseException], tuple[type[DynamoError], str]] = {
    # foreign class: (our class, what the client is told before the foreign message)
    msgspec.ValidationError: (InvalidRequestError, "invalid parameter"),
    msgspec.DecodeError: (InvalidRequestError, "the request body is not valid JSON"),
    UnicodeError: (InvalidRequestError, "the request is not valid UTF-8 text"),
    # A library refusing a value it was handed from the request (vLLM's server maps it to 400 too).
    ValueError: (InvalidRequestError, "invalid value"),
    TimeoutError: (DeadlineExceededError, "the request timed out"),  # asyncio.TimeoutError is TimeoutError
    ConnectionError: (TransportError, "a connection to a worker failed"),
}
"""Foreign exceptions the frontend's handlers can meet, each mapped to the class that says what
went wrong. Looked up along the exception's MRO, so the most specific entry wins."""


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(msgspec.Struct):
    """The error body of every route (OpenAI's shape, which its client raises as typed errors)."""

    error: ErrorDetail


_encoder = msgspec.json.Encoder()


class HttpError:
    """An error ready to send: status, encoded body and extra headers."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.body = body
        self.headers = headers


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> bytes:
    detail = ErrorDetail(message=message, type=_TYPE_BY_STATUS.get(status, "error"), param=param, code=code)
    return _encoder.encode(ErrorBody(error=detail))


def as_dynamo_error(exc: BaseException) -> DynamoError | None:
    """``exc`` itself, its translation from ``FOREIGN_ERRORS``, or None for a bug."""
    if isinstance(exc, DynamoError):
        return exc
    for cls in type(exc).__mro__:
        entry = FOREIGN_ERRORS.get(cls)
        if entry is not None:
            ours, lead = entry
            detail = str(exc)
            mapped = ours(f"{lead}: {detail}" if detail else lead)
            mapped.__cause__ = exc
            return mapped
    return None


class ErrorInfo:
    """What the client is told about a failure, before a surface shapes it into its error body."""

    __slots__ = ("status", "message", "code", "param", "headers")

    def __init__(
        self, status: int, message: str, code: str | None, param: str | None, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


def describe_error(exc: BaseException, *, request_id: str = "") -> ErrorInfo:
    """Status, message and headers for ``exc`` (the surface-independent part of the boundary);
    logs bugs with their traceback."""
    err = as_dynamo_error(exc)
    if err is None:
        logger.error("request failed with a bug request_id=%s error=%s", request_id, type(exc).__name__, exc_info=exc)
        message = f"internal error; the frontend log has the details under request_id={request_id}"
        return ErrorInfo(500, message, "internal_error", None, [])
    if err is not exc:
        logger.info(
            "request failed request_id=%s error=%s mapped=%s", request_id, type(exc).__name__, type(err).__name__
        )
    status = err.http_status
    headers: list[tuple[bytes, bytes]] = []
    if status == 503 or status == 429:
        headers.append((b"retry-after", str(max(1, math.ceil(err.retry_after_s))).encode()))
    elif status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="dynamod"'))
    return ErrorInfo(status, err.message or str(err), err.public_code, err.param, headers)


def to_http_error(exc: BaseException, *, request_id: str = "") -> HttpError:
    """The OpenAI-shaped response for ``exc``; logs bugs with their traceback."""
    info = describe_error(exc, request_id=request_id)
    code = info.code
    body = error_body(info.status, info.message, code=_OPENAI_CODES.get(code, code) if code else code, param=info.param)
    return HttpError(info.status, body, info.headers)
