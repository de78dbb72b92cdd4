"""Peer liveness on the request plane: the heartbeat settings and the dead-peer counter.

TCP keep-alive finds a peer whose node or link died, but not a process that is frozen (SIGSTOP,
a debugger) or whose event loop hangs: its kernel still answers the probes, so a stream to it
would wait for the supervisor's liveness kill. The request plane therefore runs its own
heartbeat, answered by the serving process's event loop (TCP: a ping/pong per connection, see
``framing``; NATS: server heartbeats per stream, see ``nats_wire``), and declares the peer dead
after ``timeout_s`` of silence. The streams then fail with ``TransportError``, which the frontend
migrates.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from dynamod.shared.errors import ConfigError

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0

REASON_HEARTBEAT_TIMEOUT = "heartbeat_timeout"


@dataclass(frozen=True, slots=True)
class HeartbeatConfig:
    """How often to ping a peer with open streams, and how long a silent one is given.

    ``interval_s`` 0 turns the heartbeat off (TCP keep-alive alone remains). The timeout must
    leave room for a few pings, so one delayed pong (a loaded peer, a GC pause) is not a death.
    """

    interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def validate(self) -> HeartbeatConfig:
        if self.interval_s < 0:
            raise ConfigError(f"request-plane heartbeat interval must be 0 (off) or more, got {self.interval_s}")
        if self.enabled and self.timeout_s < 2 * self.interval_s:
            raise ConfigError(
                f"request-plane heartbeat timeout ({self.timeout_s}s) must be at least twice the interval "
                f"({self.interval_s}s), so one late pong does not kill a healthy connection"
            )
        return self


class RequestPlaneMetrics:
    """The request plane's own counters (one instance per process, shared by its client and server).

    ``dynamo_component_request_plane_dead_connections_total{transport, reason}``: connections
    (TCP) or streams (NATS, which has no connection per peer) this process gave up on because the
    peer went silent. A rising count with no worker restarts points at frozen or hung workers.

    ``dynamo_component_request_plane_unauthenticated_total{transport, reason}``: connections (TCP)
    or requests (NATS) this server refused before serving anything (missing or wrong cluster token,
    failed TLS handshake, no hello in time). Any count is worth a look: a misconfigured member or
    someone knocking on the port."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.dead_connections = Counter(
            "dynamo_component_request_plane_dead_connections",
            "Request-plane connections (TCP) or streams (NATS) declared dead because the peer went silent",
            ("transport", "reason"),
            registry=registry,
        )
        self.unauthenticated = Counter(
            "dynamo_component_request_plane_unauthenticated",
            "Request-plane connections (TCP) or requests (NATS) refused before serving: bad or missing "
            "credentials",
            ("transport", "reason"),
            registry=registry,
        )

    def peer_dead(self, transport: str, reason: str = REASON_HEARTBEAT_TIMEOUT) -> None:
        self.dead_connections.labels(transport, reason).inc()

    def rejected(self, transport: str, reason: str) -> None:
        self.unauthenticated.labels(transport, reason).inc()
