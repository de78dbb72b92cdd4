"""Fixtures both request-plane transports' tests share: one NATS server per module (no JetStream:
the request plane uses core NATS only) and the address of the module's helper server process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynamod.shared.transport.plane import ServerAddress
from tests.fixtures.servers import NatsServer
from tests.integration.request_plane.helpers_transport import ServerProcess


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    with NatsServer(jetstream=False) as server:
        yield server


@pytest.fixture
def address(server_proc: ServerProcess) -> ServerAddress:
    """Where the module's ``server_proc`` (each test module starts its own) listens."""
    assert server_proc.address is not None
    return server_proc.address
