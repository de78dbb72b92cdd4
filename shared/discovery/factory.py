"""Chooses a discovery backend by name, and the defaults every role agrees on.

``dynamod up``, dynamoctl and the console must find the same file-discovery directory without
being told, so its default lives here, once. The etcd module (and with it gRPC) is imported only
when the etcd backend is chosen: single-host tools should not pay for it.
"""

from __future__ import annotations

import os

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import ConfigError

BACKENDS = ("etcd", "file", "mem")
DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_ETCD_PORT = 2379


def default_file_kv_dir() -> str:
    """``$DYN_FILE_KV``, else ``${XDG_RUNTIME_DIR:-/tmp}/dynamod-<uid>/discovery``."""
    explicit = os.environ.get("DYN_FILE_KV")
    if explicit:
        return explicit
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"dynamod-{os.getuid()}", "discovery")


def parse_etcd_endpoints(value: str) -> list[str]:
    """``"host:port,http://host2:port"`` -> ``["http://host:port", "http://host2:port"]``.

    Accepts ``host``, ``host:port``, ``[v6]:port`` and ``http://`` forms (default port 2379);
    raises ConfigError naming the bad item otherwise.
    """
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"no etcd endpoints in {value!r}; expected e.g. http://127.0.0.1:2379")
    return [_normalize_endpoint(item) for item in items]


def split_etcd_endpoint(item: str) -> tuple[str, int]:
    """``host`` / ``host:port`` / ``[v6]:port`` / ``http://host:port`` -> (host, port)."""
    rest = item.strip()
    if "://" in rest:
        scheme, _, rest = rest.partition("://")
        if scheme.lower() != "http":
            raise ConfigError(
                f"etcd endpoint {item!r}: only http:// endpoints are supported (TLS is not), e.g. http://127.0.0.1:2379"
            )
    rest = rest.rstrip("/")
    if not rest or "/" in rest:
        raise ConfigError(f"etcd endpoint {item!r} is not host:port, e.g. 127.0.0.1:2379")
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    elif rest.count(":") > 1:  # a bare IPv6 literal
        host, port = rest, ""
    else:
        host, port = rest, ""
    if not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ConfigError(f"etcd endpoint {item!r} is not host:port, e.g. 127.0.0.1:2379")
    return host, int(port) if port else DEFAULT_ETCD_PORT


def format_etcd_endpoint(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _normalize_endpoint(item: str) -> str:
    return format_etcd_endpoint(*split_etcd_endpoint(item))


def make_store(
    backend: str,
    *,
    etcd_endpoints: list[str] | None = None,
    file_root: str | None = None,
) -> DiscoveryStore:
    """An un-started store (call ``await store.start()``).

    ``etcd_endpoints`` defaults to ``$ETCD_ENDPOINTS`` or http://127.0.0.1:2379, ``file_root`` to
    ``default_file_kv_dir()``.
    """
    name = (backend or "").strip().lower()
    if name == "etcd":
        from dynamod.shared.discovery.etcd import EtcdStore

        endpoints = etcd_endpoints or parse_etcd_endpoints(
            os.environ.get("ETCD_ENDPOINTS") or DEFAULT_ETCD_ENDPOINT
        )
        return EtcdStore(endpoints)
    if name == "file":
        from dynamod.shared.discovery.file import FileStore

        return FileStore(file_root or default_file_kv_dir())
    if name == "mem":
        from dynamod.shared.discovery.mem import MemStore

        return MemStore()
    raise ConfigError(f"unknown discovery backend {backend!r}; valid: {', '.join(BACKENDS)}")
