"""deploy/kubernetes/base runs etcd and NATS at the stance of deploy/config (issue 25, item 9).

The manifests are rendered (``kustomize_lite``, overlay ``dev``) and their own settings are run
with real processes: etcd with the StatefulSet's environment, the etcd-auth Job's script with
etcdctl, and nats-server with the ConfigMap's configuration. Each refuses a client without the
cluster certificate or credentials and serves a member that has them.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import pytest

from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.errors import DiscoveryError, EventPlaneError
from dynamod.shared.events.nats_plane import NatsEventPlane
from dynamod.shared.security.settings import _FLAGS, _SWITCHES, EtcdSecurity
from tests.fixtures.servers import _find_binary, free_port
from tests.fixtures.tls import NATS_PASSWORD, ClusterCerts, cluster_certs  # noqa: F401 - fixture
from tests.integration.security.test_security_deploy_configs import DEPLOY, _start, _stop
from tests.unit.deploy.conftest import rendered

pytestmark = pytest.mark.timeout(90)

ETCD_PASSWORD = "etcd-member-password-0123456789"


def _doc(kind: str, name: str) -> dict:
    [doc] = [d for d in rendered("dev") if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _container(kind: str, name: str) -> dict:
    return _doc(kind, name)["spec"]["template"]["spec"]["containers"][0]


def test_the_runtime_config_points_every_pod_at_tls_and_credentials() -> None:
    data = _doc("ConfigMap", "dynamod-runtime")["data"]
    assert data["ETCD_ENDPOINTS"].startswith("https://") and data["NATS_SERVER"].startswith("tls://")
    known = {env for _, env, _ in _FLAGS.values()} | {env for _, env, _ in _SWITCHES.values()}
    security = {k for k in data if k.startswith("DYN_") and (k.endswith(("_FILE", "_USER")) or "TLS" in k)}
    assert security <= known, security - known
    for key in ("DYN_ETCD_CERT_FILE", "DYN_ETCD_PASSWORD_FILE", "DYN_NATS_CERT_FILE", "DYN_NATS_PASSWORD_FILE",
                "DYN_CLUSTER_TOKEN_FILE"):
        assert data[key].startswith("/etc/dynamod/secrets/"), key
    for doc in rendered("dev"):
        text = str(doc)
        assert "http://dynamod-etcd" not in text and "nats://dynamod-nats" not in text, doc["metadata"]["name"]


def _etcd_env(certs: ClusterCerts, data: Path, client: int, peer: int, metrics: int) -> dict[str, str]:
    env = {}
    for var in _container("StatefulSet", "dynamod-etcd")["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    for key in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS",
                "ETCD_INITIAL_ADVERTISE_PEER_URLS", "ETCD_INITIAL_CLUSTER"):
        assert "http://" not in env[key] and "https://" in env[key], key
    local = {
        "ETCD_NAME": "dynamod-etcd-0",
        "ETCD_DATA_DIR": str(data),
        "ETCD_LISTEN_CLIENT_URLS": f"https://127.0.0.1:{client}",
        "ETCD_ADVERTISE_CLIENT_URLS": f"https://127.0.0.1:{client}",
        "ETCD_LISTEN_PEER_URLS": f"https://127.0.0.1:{peer}",
        "ETCD_INITIAL_ADVERTISE_PEER_URLS": f"https://127.0.0.1:{peer}",
        "ETCD_INITIAL_CLUSTER": f"dynamod-etcd-0=https://127.0.0.1:{peer}",
        "ETCD_LISTEN_METRICS_URLS": f"http://127.0.0.1:{metrics}",
    }
    env.update(local)
    files = {"/etc/etcd/tls/ca.pem": certs.ca, "/etc/etcd/tls/etcd.pem": certs.node_cert,
             "/etc/etcd/tls/etcd-key.pem": certs.node_key}
    env = {k: files.get(v, v) for k, v in env.items()}
    assert not [v for v in env.values() if v.startswith("/etc/")]
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ETCD")}, **env}


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=log)


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def _job_script(certs: ClusterCerts, root: Path, client: int) -> str:
    script = _container("Job", "dynamod-etcd-auth")["args"][0]
    (root / "auth").mkdir()
    (root / "auth" / "root.password").write_text("root-password-0123456789\n")
    (root / "auth" / "etcd.password").write_text(ETCD_PASSWORD + "\n")
    return (
        script.replace("https://dynamod-etcd:2379", f"https://127.0.0.1:{client}")
        .replace("/tls/ca.pem", certs.ca).replace("/tls/etcd.pem", certs.node_cert)
        .replace("/tls/etcd-key.pem", certs.node_key).replace("/auth/", f"{root}/auth/")
    )


async def test_etcd_from_the_manifests_takes_only_members_and_its_job_turns_auth_on(
    cluster_certs: ClusterCerts, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    client, peer, metrics = free_port(), free_port(), free_port()
    env = _etcd_env(cluster_certs, tmp_path / "data", client, peer, metrics)
    proc = await asyncio.to_thread(_spawn, [_find_binary("etcd")], env, tmp_path / "etcd.log")
    try:
        await asyncio.to_thread(
            _start, ["true"], tmp_path / "wait.log", f"http://127.0.0.1:{metrics}/health", "etcd from the manifests"
        )
        url = f"https://127.0.0.1:{client}"
        stranger = EtcdStore([url], connect_timeout_s=1.0, security=EtcdSecurity(tls=cluster_certs.etcd(cert=False).tls))
        with pytest.raises(DiscoveryError):
            await stranger.start()
        await stranger.close()

        script = _job_script(cluster_certs, tmp_path, client)
        etcdctl_dir = str(Path(_find_binary("etcdctl")).parent)
        job_env = {**os.environ, "PATH": f"{etcdctl_dir}:{os.environ['PATH']}"}
        first = await asyncio.to_thread(_run, ["/bin/sh", "-ec", script], job_env)
        assert first.returncode == 0 and "etcd auth on" in first.stdout, first.stderr
        again = await asyncio.to_thread(_run, ["/bin/sh", "-ec", script], job_env)
        assert again.returncode == 0 and "already on" in again.stdout, again.stderr

        member_security = EtcdSecurity(tls=cluster_certs.etcd(user=False).tls, user="dynamod", password=ETCD_PASSWORD)
        member = EtcdStore([url], security=member_security)
        await member.start()
        await member.put("v1/probe", b"ok")
        assert await member.get("v1/probe") == b"ok"
        with pytest.raises(Exception, match="permission denied"):
            await member.put("outside/v1", b"no")
        await member.close()
        wrong = EtcdStore([url], connect_timeout_s=1.0, security=EtcdSecurity(
            tls=cluster_certs.etcd(user=False).tls, user="dynamod", password="not-the-password-000"))
        with pytest.raises(DiscoveryError):
            await wrong.start()
        await wrong.close()
    finally:
        _stop(proc)


async def test_nats_from_the_manifests_takes_only_members(cluster_certs: ClusterCerts, tmp_path: Path) -> None:  # noqa: F811
    port, monitor = free_port(), free_port()
    conf = _doc("ConfigMap", "dynamod-nats-config")["data"]["nats-server.conf"]
    assert re.search(r"verify:\s+true", conf) and 'include "../auth/nats-auth.conf"' in conf
    conf = (
        conf.replace("0.0.0.0:4222", f"127.0.0.1:{port}").replace("0.0.0.0:8222", f"127.0.0.1:{monitor}")
        .replace("/data/jetstream", str(tmp_path / "js"))
        .replace("/etc/nats/tls/nats-key.pem", cluster_certs.node_key)
        .replace("/etc/nats/tls/nats.pem", cluster_certs.node_cert)
        .replace("/etc/nats/tls/ca.pem", cluster_certs.ca)
    )
    # The pod's layout: the config in /etc/nats/config, the users in /etc/nats/auth.
    (tmp_path / "config").mkdir()
    (tmp_path / "auth").mkdir()
    (tmp_path / "config" / "nats.conf").write_text(conf)
    # Without its users file the server refuses to start: no open NATS by accident.
    check = await asyncio.to_thread(_run, [_find_binary("nats-server"), "-c", str(tmp_path / "config" / "nats.conf"), "-t"],
                                    {**os.environ, "POD_NAME": "dynamod-nats-0"})
    assert check.returncode != 0
    example = (DEPLOY / "config/nats-auth.conf.example").read_text()
    (tmp_path / "auth" / "nats-auth.conf").write_text(re.sub(r'password: "[^"]*"', f'password: "{NATS_PASSWORD}"', example))
    os.environ["POD_NAME"] = "dynamod-nats-0"
    try:
        proc = await asyncio.to_thread(_start, [_find_binary("nats-server"), "-c", str(tmp_path / "config" / "nats.conf")], tmp_path / "nats.log",
                      f"http://127.0.0.1:{monitor}/healthz", "nats-server from the manifests")
    finally:
        del os.environ["POD_NAME"]
    try:
        url = f"tls://127.0.0.1:{port}"
        member = NatsEventPlane(url, security=cluster_certs.nats())
        await member.start()
        await member.close()
        for security in (cluster_certs.nats(user=False), cluster_certs.nats(cert=False)):
            stranger = NatsEventPlane(url, connect_timeout_s=1.5, security=security)
            with pytest.raises(EventPlaneError):
                await stranger.start()
            await stranger.close()
        plain = NatsEventPlane(f"nats://127.0.0.1:{port}", connect_timeout_s=1.5)
        with pytest.raises(EventPlaneError):
            await plain.start()
        await plain.close()
    finally:
        _stop(proc)
