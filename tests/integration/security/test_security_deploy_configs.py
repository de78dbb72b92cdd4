"""The shipped etcd, NATS and systemd files are secure by default, and real servers accept them:
each config is started as shipped, with only its addresses, ports and file paths replaced by this
test's, then a member gets in and a stranger does not."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.errors import DiscoveryError, EventPlaneError
from dynamod.shared.events.nats_plane import NatsEventPlane
from dynamod.shared.security.settings import _FLAGS, _SWITCHES, EtcdSecurity
from tests.fixtures.servers import _find_binary, free_port, wait_until
from tests.fixtures.tls import NATS_PASSWORD, NATS_USER, ClusterCerts

pytestmark = pytest.mark.timeout(90)

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def _start(argv: list[str], log_path: Path, health_url: str, what: str) -> subprocess.Popen[bytes]:
    """A server process, once its health URL answers 200 (its log goes to ``log_path``)."""
    import urllib.request

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log)
    try:
        wait_until(lambda: urllib.request.urlopen(health_url, timeout=1).status == 200, 20, what=what)
    except BaseException:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _paths(text: str, certs: ClusterCerts, role: str) -> str:
    return (
        text.replace(f"/etc/dynamod/tls/{role}-key.pem", certs.node_key)
        .replace(f"/etc/dynamod/tls/{role}.pem", certs.node_cert)
        .replace("/etc/dynamod/tls/ca.pem", certs.ca)
    )


def test_shipped_etcd_config_is_locked_down() -> None:
    conf = yaml.safe_load((DEPLOY / "config/etcd.conf.yml").read_text())
    for key in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
        for url in conf[key].split(","):
            assert url.startswith("https://") and "0.0.0.0" not in url, (key, url)
    assert conf["listen-metrics-urls"].startswith("http://127.0.0.1:")
    for side in ("client-transport-security", "peer-transport-security"):
        assert conf[side]["client-cert-auth"] is True and conf[side]["trusted-ca-file"], side
        assert conf[side]["auto-tls"] is False


async def test_etcd_starts_with_the_shipped_config(cluster_certs: ClusterCerts, tmp_path: Path) -> None:
    client, peer, metrics = free_port(), free_port(), free_port()
    text = _paths((DEPLOY / "config/etcd.conf.yml").read_text(), cluster_certs, "etcd")
    text = (
        text.replace("https://10.0.0.1:2379,https://127.0.0.1:2379", f"https://127.0.0.1:{client}")
        .replace("https://10.0.0.1:2379", f"https://127.0.0.1:{client}")
        .replace("10.0.0.1:2380", f"127.0.0.1:{peer}")
        .replace("127.0.0.1:2381", f"127.0.0.1:{metrics}")
        .replace("/var/lib/etcd/dynamod", str(tmp_path / "etcd-data"))
    )
    settings = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "10.0.0.1" not in settings and "/etc/dynamod" not in settings
    config = tmp_path / "etcd.conf.yml"
    config.write_text(text)
    proc = _start([_find_binary("etcd"), "--config-file", str(config)], tmp_path / "etcd.log",
                  f"http://127.0.0.1:{metrics}/health", "etcd from the shipped config")
    try:
        member = EtcdStore([f"https://127.0.0.1:{client}"], security=cluster_certs.etcd(user=False))
        await member.start()  # auth is turned on after the first start (deploy/README.md): TLS alone here
        await member.put("v1/probe", b"ok")
        assert await member.get("v1/probe") == b"ok"
        await member.close()
        stranger = EtcdStore([f"https://127.0.0.1:{client}"], connect_timeout_s=1.0,
                             security=EtcdSecurity(tls=cluster_certs.etcd(cert=False).tls))
        with pytest.raises(DiscoveryError):
            await stranger.start()
        await stranger.close()
    finally:
        _stop(proc)


def _nats_files(certs: ClusterCerts, root: Path, port: int, monitor: int, with_auth: bool) -> Path:
    text = _paths((DEPLOY / "config/nats-server.conf").read_text(), certs, "nats")
    text = (
        text.replace("listen: 10.0.0.1:4222", f"listen: 127.0.0.1:{port}")
        .replace("127.0.0.1:8222", f"127.0.0.1:{monitor}")
        .replace("/var/lib/nats/jetstream", str(root / "js"))
    )
    assert "10.0.0.1:4222" not in text and "/etc/dynamod" not in text
    conf = root / "nats-server.conf"
    conf.write_text(text)
    if with_auth:
        example = (DEPLOY / "config/nats-auth.conf.example").read_text()
        # The example holds a placeholder bcrypt hash; the test's password goes in as is.
        auth = re.sub(r'password: "[^"]*"', f'password: "{NATS_PASSWORD}"', example)
        assert f'user: "{NATS_USER}"' in auth
        (root / "nats-auth.conf").write_text(auth)
    return conf


def test_shipped_nats_config_does_not_start_without_its_users(cluster_certs: ClusterCerts) -> None:
    with tempfile.TemporaryDirectory() as d:
        conf = _nats_files(cluster_certs, Path(d), free_port(), free_port(), with_auth=False)
        result = subprocess.run([_find_binary("nats-server"), "-c", str(conf), "-t"], capture_output=True, timeout=20)
        assert result.returncode != 0  # no nats-auth.conf: no open NATS by accident
    text = (DEPLOY / "config/nats-server.conf").read_text()
    assert re.search(r"^listen: 10\.0\.0\.1:4222", text, re.M) and "0.0.0.0" not in text.split("# Cluster of three")[0]


async def test_nats_starts_with_the_shipped_config(cluster_certs: ClusterCerts, tmp_path: Path) -> None:
    port, monitor = free_port(), free_port()
    conf = _nats_files(cluster_certs, tmp_path, port, monitor, with_auth=True)
    proc = _start([_find_binary("nats-server"), "-c", str(conf)], tmp_path / "nats.log",
                  f"http://127.0.0.1:{monitor}/healthz", "nats-server from the shipped config")
    try:
        url = f"tls://127.0.0.1:{port}"
        member = NatsEventPlane(url, security=cluster_certs.nats())
        await member.start()
        await member.close()
        # handshake_first in the shipped tls block: a TLS-first member connects too (common.env sets it).
        first = NatsEventPlane(url, security=dataclasses.replace(cluster_certs.nats(), tls_handshake_first=True))
        await first.start()
        await first.close()
        stranger = NatsEventPlane(url, connect_timeout_s=1.5, security=cluster_certs.nats(user=False))
        with pytest.raises(EventPlaneError, match="refused the credentials"):
            await stranger.start()
    finally:
        _stop(proc)


def test_shipped_env_names_are_real_flags() -> None:
    known = {env for _, env, _ in _FLAGS.values()} | {env for _, env, _ in _SWITCHES.values()}
    known |= {"DYN_CLUSTER_TOKEN", "DYN_ETCD_PASSWORD", "DYN_NATS_PASSWORD", "DYN_NATS_TOKEN"}
    texts = [(DEPLOY / "systemd" / name).read_text() for name in ("common.env.example", "dynamod@.service")]
    used = {m for text in texts for m in re.findall(r"\b(DYN_(?:[A-Z]+_)*(?:FILE|USER|TLS_[A-Z_]+|TOKEN))\b", text)}
    assert used and used <= known, used - known
    env = dict(
        line.split("=", 1) for line in texts[0].splitlines() if line and not line.startswith("#") and "=" in line
    )
    assert env["ETCD_ENDPOINTS"].startswith("https://") and env["NATS_SERVER"].startswith("tls://")
    assert env["DYN_TLS_REQUIRE_CLIENT_CERT"] == "1" and env["DYN_HOST"] != "0.0.0.0"
    assert "DYN_CLUSTER_TOKEN_FILE=%d/cluster.token" in texts[1]
    assert os.path.basename("/etc/dynamod/secrets/cluster.token") in texts[1]
