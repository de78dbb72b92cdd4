"""Shared fixtures: real etcd / NATS servers on free loopback ports, temp dirs, env isolation."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fixtures.servers import EtcdServer, NatsServer


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No test may see the developer's DYN_* settings or write to the default file-discovery dir."""
    for key in list(os.environ):
        if key.startswith("DYN_") or key in ("ETCD_ENDPOINTS", "NATS_SERVER"):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "file-kv"))


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A fresh etcd per test (restart tests mutate it)."""
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.cleanup()
