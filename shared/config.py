"""Runtime settings shared by every role: CLI flags with ``DYN_*`` environment fallbacks.

Resolution order is CLI flag, then environment variable, then default; ``--help`` prints the
variable name and the default of each. Roles add their own flags next to these. The security flags
(request-plane TLS and cluster token, etcd and NATS TLS and credentials) are defined in
``shared.security.settings`` and added here, so every role gets the same ones.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.settings import SecuritySettings, add_security_args, security_from_args
from dynamod.shared.transport.address import (
    advertised_host,
    check_advertise_host,
    is_loopback_host,
    is_wildcard,
)
from dynamod.shared.transport.admission import DEFAULT_MAX_PENDING_PER_PEER, MAX_DEFAULT_PENDING
from dynamod.shared.transport.guard import DEFAULT_HANDSHAKE_TIMEOUT_S
from dynamod.shared.transport.liveness import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HeartbeatConfig,
)
from dynamod.shared.transport.tcp_server import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
)

DISCOVERY_BACKENDS = ("etcd", "file", "mem")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("nats", "zmq")

DEFAULT_NAMESPACE = "dynamo"
DEFAULT_ETCD = "http://127.0.0.1:2379"
DEFAULT_NATS = "nats://127.0.0.1:4222"


@dataclass(slots=True)
class RuntimeSettings:
    namespace: str = DEFAULT_NAMESPACE
    discovery_backend: str = "etcd"
    etcd_endpoints: list[str] = field(default_factory=lambda: [DEFAULT_ETCD])
    file_kv: str | None = None  # None: shared.discovery.factory.default_file_kv_dir()
    request_plane: str = "tcp"
    event_plane: str = "nats"
    nats_server: str = DEFAULT_NATS
    host: str = "127.0.0.1"  # address this process's listeners bind (request plane, ZMQ, KV transfer)
    # What peers dial instead of ``host`` (NAT, or a wildcard ``host``); None: ``host`` itself, or
    # this node's primary address when ``host`` is a wildcard (transport/address.py).
    advertise_host: str | None = None
    request_plane_port: int = 0  # TCP request-plane port; 0: any free port
    system_host: str = "127.0.0.1"
    system_port: int | None = None  # None: no status server; 0: ephemeral port
    lease_ttl_s: float = 10.0
    # Request-plane liveness: ping interval (0: off) and the silence after which a peer with open
    # streams is declared dead (frozen/hung) and its streams fail over. See transport/liveness.py.
    request_plane_heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    request_plane_heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # The TCP request-plane server's caps: connections held, and how long one may idle (0: forever).
    request_plane_max_connections: int = DEFAULT_MAX_CONNECTIONS
    request_plane_idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    # Connections still in their TLS/token handshake (transport/admission.py); 0: the defaults.
    request_plane_max_pending: int = 0
    request_plane_max_pending_per_peer: int = 0
    request_plane_handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    node_name: str = field(default_factory=socket.gethostname)
    log_level: str | None = None
    # Who this process lets in and how it logs in to etcd and NATS; empty: open (loopback dev).
    security: SecuritySettings = field(default_factory=SecuritySettings)

    def validate(self) -> RuntimeSettings:
        if self.discovery_backend not in DISCOVERY_BACKENDS:
            raise ConfigError(f"unknown discovery backend {self.discovery_backend!r}; choose one of {', '.join(DISCOVERY_BACKENDS)}")
        if self.request_plane not in REQUEST_PLANES:
            raise ConfigError(f"unknown request plane {self.request_plane!r}; choose one of {', '.join(REQUEST_PLANES)}")
        if self.event_plane not in EVENT_PLANES:
            raise ConfigError(f"unknown event plane {self.event_plane!r}; choose one of {', '.join(EVENT_PLANES)}")
        if self.lease_ttl_s <= 0.5:
            raise ConfigError(f"lease TTL must be above 0.5 s, got {self.lease_ttl_s}")
        if not self.namespace or "/" in self.namespace or "." in self.namespace:
            raise ConfigError(f"namespace must be a non-empty name without '/' or '.', got {self.namespace!r}")
        if not 0 <= self.request_plane_port <= 65535:
            raise ConfigError(f"--request-plane-port must be 0..65535, got {self.request_plane_port}")
        if self.advertise_host is not None:
            try:
                self.advertise_host = check_advertise_host(self.advertise_host)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.request_plane_heartbeat.validate()
        self.request_plane_limits.validate()
        return self

    def advertised(self, bind_host: str) -> str:
        """What a listener bound to ``bind_host`` writes into discovery: ``--advertise-host`` for a
        listener on ``--host`` or a wildcard, else the bind address (a wildcard: the node's
        primary address). A listener on another specific address (a loopback status server)
        advertises that address, since it is reachable nowhere else."""
        if self.advertise_host and (bind_host == self.host or is_wildcard(bind_host)):
            return self.advertise_host
        return advertised_host(bind_host)

    def remote_discovery(self) -> str | None:
        """The first etcd endpoint or NATS server this process uses that is on another host (not
        loopback), or None: then the cluster spans hosts and loopback addresses reach nobody."""
        urls = list(self.etcd_endpoints) if self.discovery_backend == "etcd" else []
        if "nats" in (self.event_plane, self.request_plane):
            urls += [u.strip() for u in self.nats_server.split(",") if u.strip()]
        for url in urls:
            host = urlsplit(url if "://" in url else f"//{url}").hostname
            if host and not is_loopback_host(host):
                return url
        return None

    def loopback_advertise_problem(self) -> str | None:
        """Why peers on other hosts cannot reach this process's TCP request plane, or None: it
        advertises a loopback address (the default ``--host``) while discovery is on another host
        (issue 24 item 9: a frontend elsewhere dialled its own 127.0.0.1)."""
        remote = self.remote_discovery()
        advertised = self.advertised(self.host)
        if self.request_plane != "tcp" or remote is None or not is_loopback_host(advertised):
            return None
        return (
            f"this process advertises {advertised} while discovery is on another host ({remote}): processes on "
            "other hosts would dial their own loopback. Set --host to an address they reach (or 0.0.0.0), and "
            "--advertise-host when they reach it under another (NAT)"
        )

    @property
    def request_plane_heartbeat(self) -> HeartbeatConfig:
        return HeartbeatConfig(self.request_plane_heartbeat_interval_s, self.request_plane_heartbeat_timeout_s)

    @property
    def request_plane_limits(self) -> ConnectionLimits:
        # A worker judges its clients' silence by its own heartbeat settings (off with them).
        silent_s = self.request_plane_heartbeat_timeout_s if self.request_plane_heartbeat_interval_s > 0 else 0.0
        return ConnectionLimits(
            self.request_plane_max_connections, self.request_plane_idle_timeout_s, silent_s,
            max_pending=self.request_plane_max_pending, max_pending_per_peer=self.request_plane_max_pending_per_peer,
            handshake_timeout_s=self.request_plane_handshake_timeout_s,
        )


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def env_or(name: str, default: str) -> str:
    """A ``DYN_*`` variable's value, or ``default`` when it is unset or empty (flag defaults)."""
    value = _env(name)
    return default if value is None else value


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("runtime (discovery, request plane, event plane)")
    g.add_argument("--namespace", help=f"namespace to serve in [env DYN_NAMESPACE, default {DEFAULT_NAMESPACE}]")
    g.add_argument(
        "--discovery-backend",
        choices=DISCOVERY_BACKENDS,
        help="discovery backend [env DYN_DISCOVERY_BACKEND, default etcd]",
    )
    g.add_argument("--etcd-endpoints", help=f"comma-separated etcd endpoints [env ETCD_ENDPOINTS, default {DEFAULT_ETCD}]")
    g.add_argument("--file-kv", help="directory of the file discovery backend [env DYN_FILE_KV, default /tmp/dynamod-UID/discovery]")
    g.add_argument("--request-plane", choices=REQUEST_PLANES, help="request plane [env DYN_REQUEST_PLANE, default tcp]")
    g.add_argument(
        "--event-plane",
        choices=EVENT_PLANES,
        help="event plane [env DYN_EVENT_PLANE, default nats with etcd, zmq with file/mem discovery]",
    )
    g.add_argument("--nats-server", help=f"NATS URL [env NATS_SERVER, default {DEFAULT_NATS}]")
    g.add_argument(
        "--host",
        help="address the request plane, ZMQ event publishers and the KV block server bind; 0.0.0.0 = every "
        "interface [env DYN_HOST, default 127.0.0.1]",
    )
    g.add_argument(
        "--advertise-host",
        help="address other hosts dial to reach this process's listeners, written into discovery (NAT, or a "
        "wildcard --host) [env DYN_ADVERTISE_HOST, default: --host, or this host's primary address when --host "
        "is a wildcard]",
    )
    g.add_argument(
        "--request-plane-port",
        type=int,
        help="TCP port of the request plane (one per process; a firewall can then open exactly it) "
        "[env DYN_REQUEST_PLANE_PORT, default 0: any free port]",
    )
    g.add_argument("--system-port", type=int, help="port of /health,/live,/metrics; 0 = any free port [env DYN_SYSTEM_PORT, default off]")
    g.add_argument(
        "--system-host",
        help="address the status server binds; a wildcard advertises --advertise-host or the primary address "
        "[env DYN_SYSTEM_HOST, default 127.0.0.1]",
    )
    g.add_argument("--lease-ttl", type=float, help="discovery lease TTL in seconds [env DYN_LEASE_TTL, default 10]")
    g.add_argument(
        "--request-plane-heartbeat-interval",
        type=float,
        help="seconds between request-plane pings to a worker with open streams; 0 = off (TCP keep-alive only) "
        f"[env DYN_REQUEST_PLANE_HEARTBEAT_INTERVAL, default {DEFAULT_HEARTBEAT_INTERVAL_S:g}]",
    )
    g.add_argument(
        "--request-plane-heartbeat-timeout",
        type=float,
        help="seconds of silence (no data, no pong) after which a frozen or hung worker's connection is declared "
        "dead and its streams migrate (and, on a worker, after which a client that stopped pinging mid-stream is "
        "presumed frozen and its streams cancelled); at least twice the interval "
        f"[env DYN_REQUEST_PLANE_HEARTBEAT_TIMEOUT, default {DEFAULT_HEARTBEAT_TIMEOUT_S:g}]",
    )
    g.add_argument(
        "--request-plane-max-connections",
        type=int,
        help="connections this process's TCP request-plane server holds at once; more are told 'overloaded' and "
        f"closed [env DYN_REQUEST_PLANE_MAX_CONNECTIONS, default {DEFAULT_MAX_CONNECTIONS}]",
    )
    g.add_argument(
        "--request-plane-idle-timeout",
        type=float,
        help="seconds a request-plane connection with no open stream may send nothing before it is closed "
        f"(clients dial again); 0 = never [env DYN_REQUEST_PLANE_IDLE_TIMEOUT, default {DEFAULT_IDLE_TIMEOUT_S:g}]",
    )
    g.add_argument(
        "--request-plane-max-pending",
        type=int,
        help="connections (request plane and KV block server) that may be in their TLS/token handshake at once; "
        "past it the oldest such connection is closed, never an authenticated one "
        f"[env DYN_REQUEST_PLANE_MAX_PENDING, default 0: a quarter of the max connections, at most {MAX_DEFAULT_PENDING}]",
    )
    g.add_argument(
        "--request-plane-max-pending-per-peer",
        type=int,
        help="the same from one peer address "
        f"[env DYN_REQUEST_PLANE_MAX_PENDING_PER_PEER, default 0: {DEFAULT_MAX_PENDING_PER_PEER}]",
    )
    g.add_argument(
        "--request-plane-handshake-timeout",
        type=float,
        help="seconds a new connection has to finish TLS and present the cluster token before it is closed "
        f"[env DYN_REQUEST_PLANE_HANDSHAKE_TIMEOUT, default {DEFAULT_HANDSHAKE_TIMEOUT_S:g}]",
    )
    g.add_argument("--log-level", help="log level [env DYN_LOG, default info]")
    g.add_argument(
        "--trace-sample-rate",
        metavar="RATE|off",
        help="fraction of requests whose trace spans are recorded (the local ring buffer, and OTLP export when "
        "OTEL_* asks for it); failed and migrated requests are always kept; 'off': no tracing at all (no spans, "
        "no traceparent; x-request-id still echoed) [env DYN_TRACE_SAMPLE_RATE, default 1.0]",
    )
    add_security_args(parser)


def settings_from_args(ns: argparse.Namespace, **overrides: object) -> RuntimeSettings:
    """Builds settings from parsed flags, then env, then defaults. ``overrides`` replace defaults
    (not flags or env), e.g. ``dynamod up`` defaults discovery to ``file``."""
    from dynamod.shared.discovery.etcd_endpoints import parse_etcd_endpoints

    def pick(flag: str, env: str, default: object) -> object:
        value = getattr(ns, flag, None)
        if value is not None:
            return value
        env_value = _env(env)
        if env_value is not None:
            return env_value
        return overrides.get(flag, default)

    s = RuntimeSettings()
    s.namespace = str(pick("namespace", "DYN_NAMESPACE", DEFAULT_NAMESPACE))
    s.discovery_backend = str(pick("discovery_backend", "DYN_DISCOVERY_BACKEND", "etcd"))
    s.etcd_endpoints = parse_etcd_endpoints(str(pick("etcd_endpoints", "ETCD_ENDPOINTS", DEFAULT_ETCD)))
    file_kv = pick("file_kv", "DYN_FILE_KV", None)
    s.file_kv = str(file_kv) if file_kv else None
    s.request_plane = str(pick("request_plane", "DYN_REQUEST_PLANE", "tcp"))
    default_events = "nats" if s.discovery_backend == "etcd" else "zmq"
    s.event_plane = str(pick("event_plane", "DYN_EVENT_PLANE", default_events))
    s.nats_server = str(pick("nats_server", "NATS_SERVER", DEFAULT_NATS))
    s.host = str(pick("host", "DYN_HOST", "127.0.0.1"))
    s.system_host = str(pick("system_host", "DYN_SYSTEM_HOST", "127.0.0.1"))
    advertise = pick("advertise_host", "DYN_ADVERTISE_HOST", None)
    s.advertise_host = str(advertise) if advertise else None
    port = pick("system_port", "DYN_SYSTEM_PORT", None)
    try:
        s.system_port = int(port) if port is not None else None  # type: ignore[arg-type]
        s.request_plane_port = int(pick("request_plane_port", "DYN_REQUEST_PLANE_PORT", 0))  # type: ignore[arg-type]
        s.lease_ttl_s = float(pick("lease_ttl", "DYN_LEASE_TTL", 10.0))  # type: ignore[arg-type]
        s.request_plane_heartbeat_interval_s = float(
            pick(  # type: ignore[arg-type]
                "request_plane_heartbeat_interval", "DYN_REQUEST_PLANE_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL_S
            )
        )
        s.request_plane_heartbeat_timeout_s = float(
            pick(  # type: ignore[arg-type]
                "request_plane_heartbeat_timeout", "DYN_REQUEST_PLANE_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT_S
            )
        )
        s.request_plane_max_connections = int(
            pick("request_plane_max_connections", "DYN_REQUEST_PLANE_MAX_CONNECTIONS", DEFAULT_MAX_CONNECTIONS)  # type: ignore[arg-type]
        )
        s.request_plane_idle_timeout_s = float(
            pick("request_plane_idle_timeout", "DYN_REQUEST_PLANE_IDLE_TIMEOUT", DEFAULT_IDLE_TIMEOUT_S)  # type: ignore[arg-type]
        )
        s.request_plane_max_pending = int(pick("request_plane_max_pending", "DYN_REQUEST_PLANE_MAX_PENDING", 0))  # type: ignore[arg-type]
        s.request_plane_max_pending_per_peer = int(
            pick("request_plane_max_pending_per_peer", "DYN_REQUEST_PLANE_MAX_PENDING_PER_PEER", 0)  # type: ignore[arg-type]
        )
        s.request_plane_handshake_timeout_s = float(
            pick("request_plane_handshake_timeout", "DYN_REQUEST_PLANE_HANDSHAKE_TIMEOUT", DEFAULT_HANDSHAKE_TIMEOUT_S)  # type: ignore[arg-type]
        )
    except ValueError as exc:
        raise ConfigError(f"bad numeric setting: {exc}") from exc
    level = pick("log_level", "DYN_LOG", None)
    s.log_level = str(level) if level else None
    s.security = security_from_args(ns)
    return s.validate()
