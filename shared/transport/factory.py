"""Chooses the request-plane implementation by name (``DYN_REQUEST_PLANE``: ``tcp`` or ``nats``).

A process serves on one transport but may call instances of both kinds, so ``make_client``
returns one client that dispatches on ``ServerAddress.transport``; the NATS side connects only
when the first NATS instance is called.
"""

from __future__ import annotations

from typing import Any

from dynamod.shared.errors import ConfigError, TransportError
from dynamod.shared.security.settings import NatsSecurity, RequestPlaneSecurity
from dynamod.shared.transport.framing import DEFAULT_WINDOW_FRAMES
from dynamod.shared.transport.liveness import HeartbeatConfig, RequestPlaneMetrics
from dynamod.shared.transport.nats_client import NatsRequestClient
from dynamod.shared.transport.nats_server import NatsRequestServer
from dynamod.shared.transport.plane import (
    DEFAULT_MAX_FRAME_BYTES,
    RequestPlaneClient,
    RequestPlaneServer,
    ServerAddress,
)
from dynamod.shared.transport.tcp_client import TcpRequestClient
from dynamod.shared.transport.tcp_server import ConnectionLimits, TcpRequestServer

TRANSPORTS = ("tcp", "nats")


def make_server(
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    nats_url: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    security: RequestPlaneSecurity | None = None,
    nats_security: NatsSecurity | None = None,
    metrics: RequestPlaneMetrics | None = None,
    limits: ConnectionLimits | None = None,
) -> RequestPlaneServer:
    """The request-plane server for ``name``. ``host``/``port`` apply to TCP (port 0 picks a free
    one; ``advertise_host``: what discovery gets instead of ``host``); ``nats_url`` to NATS (default: ``NATS_SERVER``, else ``nats://127.0.0.1:4222``).
    ``security``: who gets served (TLS for TCP, the cluster token for both); ``nats_security``: how
    to log in to NATS; ``metrics`` counts refused peers; ``limits``: TCP connections held and idle time."""
    kind = name.strip().lower()
    if kind == "tcp":
        return TcpRequestServer(
            host, port, max_frame_bytes=max_frame_bytes, advertise_host=advertise_host, security=security, metrics=metrics,
            limits=limits,
        )
    if kind == "nats":
        return NatsRequestServer(
            nats_url, max_frame_bytes=max_frame_bytes, security=security, nats_security=nats_security, metrics=metrics
        )
    raise ConfigError(f"unknown request plane {name!r}; choose one of: {', '.join(TRANSPORTS)}")


def make_client(
    *,
    nats_url: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    heartbeat: HeartbeatConfig | None = None,
    metrics: RequestPlaneMetrics | None = None,
    security: RequestPlaneSecurity | None = None,
    nats_security: NatsSecurity | None = None,
) -> RequestPlaneClient:
    """One client for instances of either transport. ``heartbeat`` sets how quickly a frozen or
    hung server is given up on (both transports); ``metrics`` counts those give-ups; ``security``
    is what this process presents (TLS, cluster token), ``nats_security`` its NATS login."""
    return MultiTransportClient(
        nats_url=nats_url,
        max_frame_bytes=max_frame_bytes,
        heartbeat=heartbeat,
        metrics=metrics,
        security=security,
        nats_security=nats_security,
    )


class _UnknownTransportStream:
    """Fails on first read, as the contract says errors surface from iteration."""

    def __init__(self, transport: str) -> None:
        self._transport = transport

    def __aiter__(self) -> _UnknownTransportStream:
        return self

    async def __anext__(self) -> Any:
        raise TransportError(
            f"unknown request-plane transport {self._transport!r}; this client speaks {TRANSPORTS}"
        )

    async def aclose(self) -> None:
        return None


class MultiTransportClient:
    """Dispatches each stream to the TCP or NATS client by the address's transport."""

    def __init__(
        self,
        *,
        nats_url: str | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
        heartbeat: HeartbeatConfig | None = None,
        metrics: RequestPlaneMetrics | None = None,
        security: RequestPlaneSecurity | None = None,
        nats_security: NatsSecurity | None = None,
    ) -> None:
        self._nats_url = nats_url
        self._max_frame_bytes = max_frame_bytes
        self._window_frames = window_frames
        self._heartbeat = (heartbeat or HeartbeatConfig()).validate()
        self._metrics = metrics
        self._security = security
        self._nats_security = nats_security
        self.tcp = TcpRequestClient(
            max_frame_bytes=max_frame_bytes,
            window_frames=window_frames,
            heartbeat=heartbeat,
            metrics=metrics,
            security=security,
        )
        self._nats: NatsRequestClient | None = None

    @property
    def nats(self) -> NatsRequestClient:
        if self._nats is None:
            hb = self._heartbeat
            # NATS has no connection per server to ping: the server heartbeats each stream instead,
            # at the interval this client asks for, and the client gives up after the same timeout.
            # (Off for TCP keeps NATS at its own defaults: NATS has no keep-alive to fall back on.)
            extra = {"heartbeat_s": hb.interval_s, "silence_timeout_s": hb.timeout_s} if hb.enabled else {}
            self._nats = NatsRequestClient(
                self._nats_url,
                max_frame_bytes=self._max_frame_bytes,
                window_frames=self._window_frames,
                metrics=self._metrics,
                security=self._security,
                nats_security=self._nats_security,
                **extra,  # type: ignore[arg-type]
            )
        return self._nats

    def stream(
        self,
        address: ServerAddress,
        endpoint_path: str,
        body: Any,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> Any:
        if address.transport == "tcp":
            client: TcpRequestClient | NatsRequestClient = self.tcp
        elif address.transport == "nats":
            client = self.nats
        else:
            return _UnknownTransportStream(address.transport)
        return client.stream(
            address, endpoint_path, body, headers=headers, timeout_s=timeout_s, request_id=request_id
        )

    async def close(self) -> None:
        await self.tcp.close()
        if self._nats is not None:
            await self._nats.close()
