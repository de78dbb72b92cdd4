"""The one exception hierarchy of dynamod.

Every layer raises these (or subclasses) so that the HTTP frontend can map them to OpenAI-style
error bodies with the right status, and CLIs can print one line and exit non-zero::

    DynamoError
    ├── ConfigError                  bad flag, env var or settings combination
    ├── InvalidRequestError          a request body that cannot be served (HTTP 400)
    │   └── ContextLengthError       prompt + max_tokens exceed the model's context
    ├── InvalidApiKeyError           no API key, or not one this frontend accepts (HTTP 401)
    ├── RateLimitedError             this client is over its request rate (HTTP 429)
    ├── NotFoundError                unknown model, instance or endpoint (HTTP 404)
    ├── OverloadedError              no capacity right now; retry later (HTTP 503)
    ├── UnavailableError             worker is sleeping/draining/stopping (HTTP 503)
    ├── DiscoveryError               discovery backend unreachable or inconsistent
    ├── EventPlaneError              event plane unreachable
    ├── RequestPlaneError            anything on the request plane
    │   ├── TransportError           connection refused/lost, broken stream (migratable)
    │   ├── FrameTooLargeError       a frame over the negotiated maximum
    │   ├── ProtocolError            a malformed frame
    │   ├── DeadlineExceededError    the request's deadline passed
    │   ├── NoInstancesError         no live instance serves the endpoint
    │   ├── UnauthenticatedError     the peer refused our credentials (cluster token, client cert)
    │   └── RemoteError              the handler raised; carries its type and message
    └── EngineError                  the engine failed a request

Each class carries its HTTP status (``http_status``); the frontend's boundary
(``daemon/frontend/http/errors.py``) reads it from the class and never restates it. Subclasses defined in
other modules (``KvTransferError`` in ``shared/kv/transfer/base.py``, ``BodyTooLargeError`` in the
frontend, ...) register their ``code`` when their class is created, so ``error_from_wire`` knows every
class imported in the process, not only those that existed when this module was imported.
"""

from __future__ import annotations

# code -> the first class that named it; filled as classes are created (``__init_subclass__``).
_BY_CODE: dict[str, type[DynamoError]] = {}


class DynamoError(Exception):
    """Base of all dynamod errors. ``code`` is a short machine-readable name.

    ``http_status`` is the one source of the status a client gets for this class. ``param`` names
    the request parameter at fault (OpenAI's ``param``), and ``retry_after_s`` is the hint a client
    gets with a 503 or 429 (``Retry-After``; the class default unless the raiser knows better).
    """

    code: str = "internal_error"
    http_status: int = 500
    param: str | None = None
    retry_after_s: float = 1.0

    def __init__(self, message: str = "", *, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Only a class that names its own code; one that inherits it would shadow nothing.
        if "code" in cls.__dict__:
            _BY_CODE.setdefault(cls.code, cls)

    def __str__(self) -> str:
        return self.message or self.__class__.__name__

    @property
    def public_code(self) -> str:
        """The code a client sees: this error's own, or the remote one it relays."""
        return self.code


_BY_CODE[DynamoError.code] = DynamoError


class ConfigError(DynamoError):
    code = "config_error"
    http_status = 500


class InvalidRequestError(DynamoError):
    code = "invalid_request_error"
    http_status = 400

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.param = param


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class InvalidApiKeyError(DynamoError):
    """The OpenAI port's door: the request carried no API key or one the frontend does not accept.
    OpenAI's own code, so clients report it the way they report OpenAI's (``AuthenticationError``)."""

    code = "invalid_api_key"
    http_status = 401


class RateLimitedError(DynamoError):
    """This client (API key, else address) sent more requests than its rate allows; the client
    may retry after ``retry_after_s`` (sent as ``Retry-After``)."""

    code = "rate_limit_exceeded"
    http_status = 429


class NotFoundError(DynamoError):
    code = "not_found"
    http_status = 404


class OverloadedError(DynamoError):
    code = "overloaded"
    http_status = 503


class UnavailableError(DynamoError):
    code = "unavailable"
    http_status = 503


class DiscoveryError(DynamoError):
    code = "discovery_error"
    http_status = 503


class EventPlaneError(DynamoError):
    code = "event_plane_error"
    http_status = 503


class RequestPlaneError(DynamoError):
    code = "request_plane_error"
    http_status = 502


class TransportError(RequestPlaneError):
    """Connection refused or lost, or a stream that ended without its end frame.

    The frontend treats this as "the worker may be dead" and migrates the request.
    """

    code = "transport_error"


class FrameTooLargeError(RequestPlaneError):
    code = "frame_too_large"
    http_status = 413


class ProtocolError(RequestPlaneError):
    code = "protocol_error"


class DeadlineExceededError(RequestPlaneError):
    code = "deadline_exceeded"
    http_status = 504


class NoInstancesError(RequestPlaneError):
    code = "no_instances"
    http_status = 503


class UnauthenticatedError(RequestPlaneError):
    """A request-plane server refused this process's credentials (missing or wrong cluster token,
    no client certificate). A configuration problem, not a dead worker: not migrated."""

    code = "unauthenticated"
    http_status = 503


class RemoteError(RequestPlaneError):
    """The remote handler raised. ``remote_code`` is the remote error's ``code``."""

    code = "remote_error"

    def __init__(self, message: str = "", *, remote_code: str = "internal_error", http_status: int = 500) -> None:
        super().__init__(message)
        self.remote_code = remote_code
        self.http_status = http_status

    @property
    def public_code(self) -> str:
        return self.remote_code


class EngineError(DynamoError):
    code = "engine_error"
    http_status = 500


def error_to_wire(exc: BaseException) -> dict[str, object]:
    """Encodes an exception for an error frame on the request plane."""
    if isinstance(exc, RemoteError):
        return {"code": exc.remote_code, "message": exc.message, "status": exc.http_status}
    if isinstance(exc, DynamoError):
        return {"code": exc.code, "message": exc.message or str(exc), "status": exc.http_status}
    return {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}", "status": 500}


def error_from_wire(err: dict[str, object]) -> DynamoError:
    """Rebuilds an exception from an error frame.

    Known client-facing codes (invalid request, not found, overloaded, unavailable) and the request
    plane's own failures (frame too large, protocol error, deadline) come back as their own class so
    callers can branch on type; everything else is a ``RemoteError``.
    """
    code = str(err.get("code", "internal_error"))
    message = str(err.get("message", ""))
    status = int(err.get("status", 500))  # type: ignore[arg-type]
    cls = _BY_CODE.get(code)
    if cls is not None and issubclass(
        cls,
        InvalidRequestError
        | NotFoundError
        | OverloadedError
        | UnavailableError
        | EngineError
        | FrameTooLargeError
        | ProtocolError
        | DeadlineExceededError
        | UnauthenticatedError,
    ):
        return cls(message)
    return RemoteError(message, remote_code=code, http_status=status)
