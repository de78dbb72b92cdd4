"""Discovery on an etcd that requires TLS with client certificates and has its auth on: a member
with the cluster's files and the etcd user works as on a plain etcd (leases, watches); anyone
missing one of them is refused with one line saying what to fix."""

from __future__ import annotations

import pytest

from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.discovery.etcd_endpoints import parse_etcd_endpoints
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.discovery.store import WatchEventKind
from dynamod.shared.errors import ConfigError, DiscoveryError
from dynamod.shared.security.settings import EtcdSecurity
from dynamod.shared.security.tls import TlsFiles
from tests.fixtures.servers import EtcdServer
from tests.fixtures.tls import ETCD_USER, ClusterCerts

pytestmark = pytest.mark.timeout(90)


async def test_member_registers_and_watches(secure_etcd: EtcdServer, cluster_certs: ClusterCerts) -> None:
    store = make_store("etcd", etcd_endpoints=[secure_etcd.endpoint], etcd_security=cluster_certs.etcd())
    await store.start()
    watcher = make_store("etcd", etcd_endpoints=[secure_etcd.endpoint], etcd_security=cluster_certs.etcd())
    await watcher.start()
    try:
        lease = await store.create_lease(3)
        await store.put("v1/instances/dynamo/backend/generate/1", b"{}", lease)
        watch = watcher.watch_prefix("v1/instances/")
        first = await anext(watch)
        assert first.kind is WatchEventKind.PUT and first.key.endswith("/1")
        await store.put("v1/instances/dynamo/backend/generate/2", b"{}", lease)
        second = await anext(watch)
        assert second.key.endswith("/2")
        await lease.revoke()
        gone = {(await anext(watch)).key for _ in range(2)}
        assert gone == {first.key, second.key}
        await watch.aclose()
        # The etcd role grants v1/ only: the user cannot write elsewhere (etcd enforces it, we report it).
        with pytest.raises(DiscoveryError, match="permission denied"):
            await store.put("not-ours/key", b"x")
    finally:
        await store.close()
        await watcher.close()


@pytest.mark.parametrize(
    ("what", "security", "needle"),
    [
        # Without a user etcd takes the certificate's common name, which is no etcd user here.
        ("no etcd user", lambda c: c.etcd(user=False), "without --etcd-user"),
        (
            "wrong password",
            lambda c: EtcdSecurity(tls=c.etcd().tls, user=ETCD_USER, password="not-the-password"),
            "refused the user or password",
        ),
        ("no client certificate", lambda c: c.etcd(cert=False), "unreachable"),
        ("a foreign CA", lambda c: c.etcd(ca=c.rogue_ca), "--etcd-ca-file"),
    ],
)
async def test_strangers_are_refused(
    secure_etcd: EtcdServer, cluster_certs: ClusterCerts, what: str, security, needle: str
) -> None:
    store = EtcdStore([secure_etcd.endpoint], connect_timeout_s=1.5, security=security(cluster_certs))
    with pytest.raises(DiscoveryError, match=needle):
        await store.start()
    await store.close()


async def test_plaintext_client_cannot_reach_a_tls_etcd(secure_etcd: EtcdServer) -> None:
    plain = secure_etcd.endpoint.replace("https://", "http://")
    store = EtcdStore([plain], connect_timeout_s=1.0)
    with pytest.raises(DiscoveryError, match="unreachable"):
        await store.start()
    await store.close()


def test_endpoint_schemes_are_checked(cluster_certs: ClusterCerts) -> None:
    assert parse_etcd_endpoints("https://etcd-0:2379,https://10.0.0.2") == [
        "https://etcd-0:2379",
        "https://10.0.0.2:2379",
    ]
    with pytest.raises(ConfigError, match="mix"):
        parse_etcd_endpoints("https://etcd-0:2379,http://etcd-1:2379")
    with pytest.raises(ConfigError, match="use https://"):
        EtcdStore(["http://127.0.0.1:2379"], security=EtcdSecurity(tls=TlsFiles(cluster_certs.ca)))
    with pytest.raises(ConfigError, match="needs its key"):
        EtcdStore(["https://127.0.0.1:2379"], security=EtcdSecurity(tls=TlsFiles(cluster_certs.ca, cluster_certs.node_cert)))
