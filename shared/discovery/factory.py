"""Chooses a discovery backend by name, and the defaults every role agrees on.

``dynamod up``, dynamoctl and the console must find the same file-discovery directory without
being told, so its default lives here, once. The etcd module (and with it gRPC) is imported only
when the etcd backend is chosen: single-host tools should not pay for it.
"""

from __future__ import annotations

import os

from dynamod.shared.discovery.etcd_endpoints import DEFAULT_ETCD_ENDPOINT, parse_etcd_endpoints
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import ConfigError
from dynamod.shared.security.private_dir import user_runtime_dir
from dynamod.shared.security.settings import EtcdSecurity

BACKENDS = ("etcd", "file", "mem")


def default_file_kv_dir() -> str:
    """``$DYN_FILE_KV``, else ``${XDG_RUNTIME_DIR:-/tmp}/dynamod-<uid>/discovery``."""
    explicit = os.environ.get("DYN_FILE_KV")
    if explicit:
        return explicit
    return str(user_runtime_dir() / "discovery")


def make_store(
    backend: str,
    *,
    etcd_endpoints: list[str] | None = None,
    file_root: str | None = None,
    etcd_security: EtcdSecurity | None = None,
) -> DiscoveryStore:
    """An un-started store (call ``await store.start()``).

    ``etcd_endpoints`` defaults to ``$ETCD_ENDPOINTS`` or http://127.0.0.1:2379, ``file_root`` to
    ``default_file_kv_dir()``. ``etcd_security``: TLS files (with ``https://`` endpoints) and the
    etcd user to log in as.
    """
    name = (backend or "").strip().lower()
    if name == "etcd":
        from dynamod.shared.discovery.etcd import EtcdStore

        endpoints = etcd_endpoints or parse_etcd_endpoints(
            os.environ.get("ETCD_ENDPOINTS") or DEFAULT_ETCD_ENDPOINT
        )
        return EtcdStore(endpoints, security=etcd_security)
    if name == "file":
        from dynamod.shared.discovery.file import FileStore

        return FileStore(file_root or default_file_kv_dir())
    if name == "mem":
        from dynamod.shared.discovery.mem import MemStore

        return MemStore()
    raise ConfigError(f"unknown discovery backend {backend!r}; valid: {', '.join(BACKENDS)}")
