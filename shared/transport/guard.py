"""Who gets served: the request plane's side of the cluster's security settings.

``ServerGuard`` is what a request-plane server checks before it dispatches anything: the TLS
context it wraps connections in (mutual when client certificates are required) and the cluster
token a peer must present. Every refusal is counted (``RequestPlaneMetrics.rejected``) and logged
once per peer and reason per minute. Wrong or missing tokens are also counted per peer address
(``shared/security/rate_limit``): past ``DEFAULT_AUTH_FAILURE_BURST`` of them (then one a second)
``guessing`` says so and the listener closes that address's new connections before reading a byte,
so the token cannot be guessed at connection speed. ``ClientCredentials`` is the calling side: the TLS context it
dials with and the token it presents. Both are built from ``RequestPlaneSecurity`` at start-up, so
a bad certificate path is a ConfigError before the first request, not a failure during it.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from dynamod.shared.errors import UnauthenticatedError
from dynamod.shared.security.rate_limit import (
    DEFAULT_AUTH_FAILURE_BURST,
    DEFAULT_AUTH_FAILURE_RATE,
    RateLimiter,
)
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.security.tls import client_context, server_context
from dynamod.shared.security.token import (
    REASON_BAD_TOKEN,
    REASON_MISSING_TOKEN,
    ClusterToken,
    RejectionLog,
)
from dynamod.shared.transport.admission import peer_host
from dynamod.shared.transport.framing import CONNECTION_STREAM_ID, ClientFrame
from dynamod.shared.transport.liveness import RequestPlaneMetrics

DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
"""How long a new connection may take to finish TLS and present its token; then it is closed."""

_hello_decoder = msgspec.msgpack.Decoder(ClientFrame)


class ServerGuard:
    """The checks a request-plane server applies to a new peer (see the module docstring)."""

    def __init__(
        self,
        security: RequestPlaneSecurity | None,
        *,
        transport: str,
        metrics: RequestPlaneMetrics | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    ) -> None:
        security = security or RequestPlaneSecurity()
        self.transport = transport
        self.token: ClusterToken | None = security.token
        self.ssl_context = (
            server_context(security.tls, require_client_cert=security.require_client_cert, what="request plane")
            if security.tls_enabled
            else None
        )
        self.handshake_timeout_s = handshake_timeout_s
        self.describe = security.describe()
        self._metrics = metrics
        self._log = RejectionLog(f"request_plane.{transport}")
        self._failures = RateLimiter(DEFAULT_AUTH_FAILURE_RATE, DEFAULT_AUTH_FAILURE_BURST) if self.token else None

    def guessing(self, peer: object) -> bool:
        """True while ``peer``'s address has used up its failed token checks (closed unread)."""
        if self._failures is None:
            return False
        return self._failures.waiting(peer_host(peer)) > 0.0

    @property
    def open(self) -> bool:
        """Nothing to check: every peer is served (the loopback default)."""
        return self.token is None and self.ssl_context is None

    def check_token(self, presented: str | None) -> str | None:
        """None when ``presented`` is the cluster token (or none is required), else the reason."""
        if self.token is None:
            return None
        if presented is None:
            return REASON_MISSING_TOKEN
        return None if self.token.matches(presented) else REASON_BAD_TOKEN

    def check_hello(self, payload: bytes) -> str | None:
        """The first frame of a TCP connection: None when it is a hello with the right token."""
        try:
            frame = _hello_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return REASON_MISSING_TOKEN
        if frame.stream_id != CONNECTION_STREAM_ID or frame.auth is UNSET:
            return REASON_MISSING_TOKEN
        return self.check_token(frame.auth)  # type: ignore[arg-type]

    def reject(self, peer: str, reason: str, detail: str = "") -> UnauthenticatedError:
        """Counts and logs a refusal; returns the error the peer is told (it names no secret)."""
        if self._metrics is not None:
            self._metrics.rejected(self.transport, reason)
        self._log.rejected(peer, reason, detail)
        if self._failures is not None and reason in (REASON_BAD_TOKEN, REASON_MISSING_TOKEN):
            self._failures.acquire(peer_host(peer))
        if reason == REASON_BAD_TOKEN:
            return UnauthenticatedError("the cluster token presented does not match this server's")
        return UnauthenticatedError(
            "this server requires the cluster token (--cluster-token-file / DYN_CLUSTER_TOKEN)"
        )


class ClientCredentials:
    """What a request-plane client presents: its TLS context (None: plaintext) and its token."""

    def __init__(self, security: RequestPlaneSecurity | None) -> None:
        security = security or RequestPlaneSecurity()
        self.token = security.token.value if security.token is not None else None
        self.ssl_context = (
            client_context(security.tls, check_hostname=security.verify_hostname, what="request plane")
            if security.tls_enabled
            else None
        )

    def hello(self) -> ClientFrame | None:
        return ClientFrame(CONNECTION_STREAM_ID, auth=self.token) if self.token is not None else None
