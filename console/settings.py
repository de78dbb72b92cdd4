"""How the console and dynamoctl find a cluster: flags with the project's env fallbacks.

With no flags they find a ``dynamod up`` cluster on this machine: file discovery in
``default_file_kv_dir()`` and ZMQ events. ``--discovery etcd`` switches to etcd and NATS.
``--namespace`` limits the view to one namespace; without it every namespace is shown. The security
flags (cluster token, request-plane TLS, etcd and NATS TLS and credentials) are the daemons' own
(``shared.security.settings``), with the same ``DYN_*`` variables, so one environment file serves both.

A frontend with API keys refuses ``/metrics`` without one (it takes the cluster token too): the
console and dynamoctl present the key the frontend's own variables name (``DYN_API_KEY``, else the
first key of ``--api-key-file`` / ``DYN_API_KEY_FILE``), so REQ/S, TTFT and ITL are not ``-``. An
HTTPS frontend with a private CA is read with ``--frontend-ca-file``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from dynamod.shared.config import DEFAULT_ETCD, DEFAULT_NAMESPACE, DEFAULT_NATS, RuntimeSettings
from dynamod.shared.errors import ConfigError
from dynamod.shared.security.secrets import read_secret_file
from dynamod.shared.security.settings import SecuritySettings, add_security_args, security_from_args

DISCOVERY_CHOICES = ("file", "etcd")
# Where `dynamod up` serves HTTP by default: scraped when nothing else is known, so the Models view
# fills in on a local cluster with no flags.
LOCAL_FRONTEND_URL = "http://127.0.0.1:8000"


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


@dataclass(slots=True)
class ConsoleSettings:
    discovery: str = "file"
    etcd_endpoints: list[str] = field(default_factory=lambda: [DEFAULT_ETCD])
    nats_server: str = DEFAULT_NATS
    file_kv: str | None = None
    namespace: str | None = None  # None: every namespace
    event_plane: str | None = None  # None: nats with etcd, zmq with file
    frontend_urls: list[str] = field(default_factory=list)
    guessed_frontend_urls: list[str] = field(default_factory=list)  # tried without being asked: no answer is no news
    scrape_interval_s: float = 2.0
    probe_interval_s: float = 2.0
    retry_max_s: float = 5.0
    security: SecuritySettings = field(default_factory=SecuritySettings)
    api_key: str | None = field(default=None, repr=False)  # presented to frontends' /metrics
    api_key_source: str = ""  # where it came from, for "refused" messages (never the key)
    frontend_ca_file: str | None = None  # verifies https:// frontends

    @property
    def resolved_event_plane(self) -> str:
        return self.event_plane or ("nats" if self.discovery == "etcd" else "zmq")

    def describe(self) -> str:
        """Where this console looks, in one line (shown in the top bar and in errors)."""
        if self.discovery == "etcd":
            where = f"etcd {','.join(self.etcd_endpoints)}"
        else:
            from dynamod.shared.discovery.factory import default_file_kv_dir

            where = f"file {self.file_kv or default_file_kv_dir()}"
        events = f"nats {self.nats_server}" if self.resolved_event_plane == "nats" else "zmq"
        return f"{where} | events {events} | ns {self.namespace or '*'}"

    def discovery_target(self) -> str:
        if self.discovery == "etcd":
            return ",".join(self.etcd_endpoints)
        from dynamod.shared.discovery.factory import default_file_kv_dir

        return self.file_kv or default_file_kv_dir()

    def runtime_settings(self) -> RuntimeSettings:
        """Settings for the console's own runtime: it serves nothing, it only watches and calls."""
        s = RuntimeSettings()
        s.namespace = self.namespace or DEFAULT_NAMESPACE
        s.discovery_backend = self.discovery
        s.etcd_endpoints = list(self.etcd_endpoints)
        s.file_kv = self.file_kv
        s.event_plane = self.resolved_event_plane
        s.nats_server = self.nats_server
        s.system_port = None
        s.security = self.security
        return s.validate()


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("connection")
    g.add_argument(
        "--discovery",
        choices=DISCOVERY_CHOICES,
        help="discovery backend [env DYN_DISCOVERY_BACKEND, default file: finds `dynamod up` on this machine]",
    )
    g.add_argument("--etcd", help=f"comma-separated etcd endpoints [env ETCD_ENDPOINTS, default {DEFAULT_ETCD}]")
    g.add_argument("--nats", help=f"NATS URL [env NATS_SERVER, default {DEFAULT_NATS}]")
    g.add_argument("--file-kv", help="file discovery directory [env DYN_FILE_KV, default /tmp/dynamod-UID/discovery]")
    g.add_argument("--namespace", help="show one namespace only [env DYN_NAMESPACE, default: all]")
    g.add_argument("--event-plane", choices=("nats", "zmq"), help="event plane [default nats with etcd, zmq with file]")
    g.add_argument(
        "--frontend-url",
        action="append",
        default=[],
        metavar="URL",
        help="also scrape this frontend's /metrics (repeatable); registered frontends are found on their own",
    )
    g.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a frontend API keys file: its first key is presented to frontends' /metrics when they have API keys "
        "[env DYN_API_KEY_FILE; or the key itself in DYN_API_KEY]",
    )
    g.add_argument("--frontend-ca-file", metavar="PATH",
                   help="CA (PEM) that verifies https:// frontends' /metrics [env DYN_FRONTEND_CA_FILE, default system CAs]")
    add_security_args(parser)


def first_api_key(path: str) -> str:
    """The first key of a frontend keys file (one per line; ``#`` comments and blanks skipped)."""
    for line in read_secret_file(path, "API keys file").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line
    raise ConfigError("API keys file holds no key")


def api_key_from(ns: argparse.Namespace) -> tuple[str | None, str]:
    """(key, where it came from): ``DYN_API_KEY``'s first key, else the keys file's first key."""
    for key in (_env("DYN_API_KEY") or "").split(","):
        if key.strip():
            return key.strip(), "DYN_API_KEY"
    path = getattr(ns, "api_key_file", None) or _env("DYN_API_KEY_FILE")
    if path:
        return first_api_key(path), "--api-key-file"
    return None, ""


def settings_from_args(ns: argparse.Namespace) -> ConsoleSettings:
    from dynamod.shared.discovery.etcd_endpoints import parse_etcd_endpoints

    s = ConsoleSettings()
    discovery = getattr(ns, "discovery", None) or _env("DYN_DISCOVERY_BACKEND") or "file"
    if discovery not in DISCOVERY_CHOICES:
        raise ConfigError(f"the console reads discovery from {' or '.join(DISCOVERY_CHOICES)}, not {discovery!r}")
    s.discovery = discovery
    s.etcd_endpoints = parse_etcd_endpoints(getattr(ns, "etcd", None) or _env("ETCD_ENDPOINTS") or DEFAULT_ETCD)
    s.nats_server = getattr(ns, "nats", None) or _env("NATS_SERVER") or DEFAULT_NATS
    s.file_kv = getattr(ns, "file_kv", None) or _env("DYN_FILE_KV")
    s.namespace = getattr(ns, "namespace", None) or _env("DYN_NAMESPACE")
    s.event_plane = getattr(ns, "event_plane", None) or _env("DYN_EVENT_PLANE")
    s.frontend_urls = [u.rstrip("/") for u in getattr(ns, "frontend_url", None) or []]
    if not s.frontend_urls and s.discovery == "file":
        s.frontend_urls = [LOCAL_FRONTEND_URL]
        s.guessed_frontend_urls = [f"{LOCAL_FRONTEND_URL}/metrics"]
    if s.namespace is not None and ("/" in s.namespace or "." in s.namespace):
        raise ConfigError(f"namespace must be a name without '/' or '.', got {s.namespace!r}")
    s.security = security_from_args(ns)
    s.api_key, s.api_key_source = api_key_from(ns)
    s.frontend_ca_file = getattr(ns, "frontend_ca_file", None) or _env("DYN_FRONTEND_CA_FILE")
    return s
