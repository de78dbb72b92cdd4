"""NATS with TLS (client certificates verified) and user/password auth: the event plane and the
NATS request plane of a member work; a process without the credentials, the cluster's CA or its
certificate is refused with one line saying what to check; the cluster token still guards each
request on the NATS request plane; a process set up for TLS refuses a plaintext server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dynamod.shared.errors import EventPlaneError, TransportError, UnauthenticatedError
from dynamod.shared.events.nats_plane import NatsEventPlane
from dynamod.shared.security.settings import NatsSecurity, RequestPlaneSecurity
from dynamod.shared.security.tls import TlsFiles
from dynamod.shared.transport.liveness import RequestPlaneMetrics
from dynamod.shared.transport.nats_client import NatsRequestClient
from dynamod.shared.transport.nats_server import NatsRequestServer
from dynamod.shared.transport.plane import RequestContext
from tests.fixtures.request_plane import unauthenticated
from tests.fixtures.servers import NatsServer
from tests.fixtures.tls import NATS_PASSWORD, NATS_USER, ClusterCerts

pytestmark = pytest.mark.timeout(90)


async def test_member_publishes_and_subscribes(secure_nats: NatsServer, cluster_certs: ClusterCerts) -> None:
    sub_plane = NatsEventPlane(secure_nats.url, name="sec-sub", security=cluster_certs.nats())
    pub_plane = NatsEventPlane(secure_nats.url, name="sec-pub", security=cluster_certs.nats())
    await sub_plane.start()
    await pub_plane.start()
    try:
        sub = await sub_plane.subscribe("ns", "worker", "kv-events")
        pub = await pub_plane.publisher("ns", "worker", "kv-events")
        await pub.publish("kv-events", b"over tls")
        message = await asyncio.wait_for(anext(aiter(sub)), 10)
        assert message.payload == b"over tls"
    finally:
        await pub_plane.close()
        await sub_plane.close()


@pytest.mark.parametrize(
    ("what", "security", "needle"),
    [
        ("no credentials", lambda c: c.nats(user=False), "refused the credentials"),
        (
            "wrong password",
            lambda c: NatsSecurity(tls=c.nats().tls, user=NATS_USER, password="not-the-password"),
            "refused the credentials",
        ),
        ("no client certificate", lambda c: c.nats(cert=False), "cannot connect"),
        ("a foreign CA", lambda c: c.nats(ca=c.rogue_ca), "--nats-ca-file"),
        ("no TLS settings", lambda c: None, "cannot connect"),
    ],
)
async def test_strangers_are_refused(
    secure_nats: NatsServer, cluster_certs: ClusterCerts, what: str, security: Any, needle: str
) -> None:
    plane = NatsEventPlane(secure_nats.url, connect_timeout_s=1.5, security=security(cluster_certs))
    with pytest.raises(EventPlaneError, match=needle):
        await plane.start()


async def test_tls_configured_client_refuses_a_plaintext_server(
    nats_server: NatsServer, cluster_certs: ClusterCerts
) -> None:
    plane = NatsEventPlane(nats_server.url, connect_timeout_s=2.0, security=NatsSecurity(tls=TlsFiles(cluster_certs.ca)))
    with pytest.raises(EventPlaneError, match="does not use TLS"):
        await plane.start()


async def test_nats_request_plane_needs_nats_login_and_the_cluster_token(
    secure_nats: NatsServer, cluster_certs: ClusterCerts
) -> None:
    member = cluster_certs.request_plane(tls=False)
    registry = CollectorRegistry()
    server = NatsRequestServer(
        secure_nats.url, security=member, nats_security=cluster_certs.nats(), metrics=RequestPlaneMetrics(registry)
    )
    calls: list[Any] = []

    async def echo(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        calls.append(body)
        yield {"echo": body}

    server.register("dynamo/backend/generate/1", echo)
    address = await server.start()
    clients: list[NatsRequestClient] = []

    def client(security: RequestPlaneSecurity | None, nats_security: NatsSecurity | None) -> NatsRequestClient:
        c = NatsRequestClient(secure_nats.url, security=security, nats_security=nats_security)
        clients.append(c)
        return c

    async def call(c: NatsRequestClient, body: Any) -> list[Any]:
        return [item async for item in c.stream(address, "dynamo/backend/generate/1", body, timeout_s=10)]

    try:
        assert await call(client(member, cluster_certs.nats()), "member") == [{"echo": "member"}]
        with pytest.raises(UnauthenticatedError):
            await call(client(None, cluster_certs.nats()), "nats user without the token")
        with pytest.raises(TransportError, match="cannot connect to NATS"):
            await call(client(member, cluster_certs.nats(user=False)), "token without a NATS login")
        assert calls == ["member"]
        assert unauthenticated(registry, "nats", "missing_token") == 1
    finally:
        for c in clients:
            await c.close()
        await server.stop(grace_s=0)


def test_nats_credentials_kinds_are_exclusive(tmp_path) -> None:
    import argparse

    from dynamod.shared.errors import ConfigError
    from dynamod.shared.security.settings import security_from_args

    token = tmp_path / "nats.token"
    token.write_text("a-nats-token\n")
    ns = argparse.Namespace(nats_user="u", nats_token_file=str(token))
    with pytest.raises(ConfigError, match="one kind of credentials"):
        security_from_args(ns)
    assert security_from_args(argparse.Namespace(nats_token_file=str(token))).nats.token == "a-nats-token"
    assert NATS_PASSWORD not in repr(NatsSecurity(user=NATS_USER, password=NATS_PASSWORD))
