"""NATS TLS handshake-first: a client set up for it starts TLS before reading a byte, so a server
(or a man in the middle) speaking a plaintext INFO first is refused before any login is sent.

Real nats-server processes: one with ``handshake_first`` in its tls block (members connect), one
with TLS the INFO-first way and one without TLS (both refused). A recording socket shows what a
client sends to an INFO that drops ``tls_required``: the login in the clear without the switch (the
downgrade the switch exists for), only a TLS ClientHello with it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json

import pytest

from dynamod.shared.errors import ConfigError, EventPlaneError, TransportError
from dynamod.shared.events.nats_plane import NatsEventPlane
from dynamod.shared.security.settings import add_security_args, security_from_args
from dynamod.shared.transport import nats_wire
from tests.fixtures.servers import NatsServer
from tests.fixtures.tls import NATS_PASSWORD, ClusterCerts, nats_config

pytestmark = pytest.mark.timeout(90)

_TLS_RECORD_HANDSHAKE = 0x16  # first byte of a TLS ClientHello record


def first(security):
    return dataclasses.replace(security, tls_handshake_first=True)


@pytest.fixture(scope="module")
def handshake_first_nats(cluster_certs: ClusterCerts):  # noqa: ANN201 - generator fixture
    config = nats_config(cluster_certs).replace("timeout: 2", "timeout: 2\n  handshake_first: true", 1)
    assert "handshake_first" in config
    with NatsServer(jetstream=False, config=config, tls=True) as server:
        yield server


async def test_members_connect_handshake_first(handshake_first_nats: NatsServer, cluster_certs: ClusterCerts) -> None:
    security = first(cluster_certs.nats())
    sub_plane = NatsEventPlane(handshake_first_nats.url, name="hf-sub", security=security)
    pub_plane = NatsEventPlane(handshake_first_nats.url, name="hf-pub", security=security)
    await sub_plane.start()
    await pub_plane.start()
    try:
        sub = await sub_plane.subscribe("ns", "worker", "kv-events")
        pub = await pub_plane.publisher("ns", "worker", "kv-events")
        await pub.publish("kv-events", b"tls from the first byte")
        assert (await asyncio.wait_for(anext(aiter(sub)), 10)).payload == b"tls from the first byte"
    finally:
        await pub_plane.close()
        await sub_plane.close()
    # The request plane's connection uses the same options.
    nc = await nats_wire.connect(handshake_first_nats.url, name="hf-rp", connect_timeout_s=5, security=security)
    await nc.close()


async def test_info_first_servers_are_refused(
    secure_nats: NatsServer, nats_server: NatsServer, cluster_certs: ClusterCerts
) -> None:
    security = first(cluster_certs.nats())
    # TLS the classic way (plaintext INFO, then the upgrade) and no TLS at all: both speak first.
    for server in (secure_nats, nats_server):
        plane = NatsEventPlane(server.url, connect_timeout_s=2.0, security=security)
        with pytest.raises(EventPlaneError, match="cannot connect"):
            await plane.start()
        with pytest.raises(TransportError, match="cannot connect"):
            await nats_wire.connect(server.url, name="hf-rp", connect_timeout_s=2.0, security=security)


class RecordingServer:
    """Speaks one plaintext INFO without ``tls_required`` (a stripping man in the middle) and
    records what the client sends back."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.got_bytes = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "mitm", "version": "2.10.0", "max_payload": 1048576, "auth_required": True}
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        try:
            while chunk := await asyncio.wait_for(reader.read(4096), 5):
                self.received += chunk
                self.got_bytes.set()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.mark.parametrize("handshake_first", [False, True])
async def test_what_a_stripping_man_in_the_middle_reads(cluster_certs: ClusterCerts, handshake_first: bool) -> None:
    mitm = RecordingServer()
    url = await mitm.start()
    security = cluster_certs.nats()
    plane = NatsEventPlane(
        url, connect_timeout_s=1.5, security=first(security) if handshake_first else security
    )
    try:
        with pytest.raises(EventPlaneError):
            await plane.start()
        await asyncio.wait_for(mitm.got_bytes.wait(), 5)
    finally:
        await mitm.stop()
    if handshake_first:
        assert mitm.received[0] == _TLS_RECORD_HANDSHAKE
        assert b"CONNECT" not in mitm.received and NATS_PASSWORD.encode() not in mitm.received
    else:
        # Why the switch exists: tls_missing refuses the connection, but only after the login left.
        assert mitm.received.startswith(b"CONNECT") and NATS_PASSWORD.encode() in mitm.received


def test_switch_from_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_security_args(parser)
    assert "--nats-tls-handshake-first" in parser.format_help()
    assert security_from_args(parser.parse_args(["--nats-tls-handshake-first"])).nats.tls_handshake_first
    assert not security_from_args(parser.parse_args([])).nats.tls_handshake_first
    monkeypatch.setenv("DYN_NATS_TLS_HANDSHAKE_FIRST", "1")
    assert security_from_args(parser.parse_args([])).nats.tls_handshake_first
    monkeypatch.setenv("DYN_NATS_TLS_HANDSHAKE_FIRST", "maybe")
    with pytest.raises(ConfigError, match="DYN_NATS_TLS_HANDSHAKE_FIRST"):
        security_from_args(parser.parse_args([]))
