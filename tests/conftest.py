"""Shared fixtures: real etcd / NATS servers on free loopback ports, temp dirs, env isolation."""

from __future__ import annotations

import logging
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


@pytest.fixture(autouse=True)
def _isolated_logging() -> Iterator[None]:
    """A command run in-process (``dynamod replay``, ``dynamoctl``) configures the root logger for
    the whole process; the next test must start from the logging it would have on its own."""
    from dynamod.shared.observability import logging as dyn_logging

    root = logging.getLogger()
    handlers, level, configured = list(root.handlers), root.level, dyn_logging._CONFIGURED
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    dyn_logging._CONFIGURED = configured


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A fresh etcd per test (restart tests mutate it)."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server
