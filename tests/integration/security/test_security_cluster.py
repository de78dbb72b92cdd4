"""A whole cluster with every door locked: etcd over TLS with client certificates and auth, NATS over
TLS with client certificates and a user, the request plane with mutual TLS and the cluster token.
A frontend and a mocker worker (real processes) serve a chat completion; dynamoctl with the same
settings operates the worker, and without the token or its certificate it is refused in one line
while the worker counts the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.servers import EtcdServer, NatsServer, free_port, wait_until
from tests.fixtures.tls import ETCD_PASSWORD, ETCD_USER, NATS_PASSWORD, NATS_USER, ClusterCerts
from tests.integration.frontend.test_frontend_support import CLI, Proc, get_json

pytestmark = pytest.mark.timeout(240)


def secure_env(certs: ClusterCerts, etcd: EtcdServer, nats: NatsServer, root: Path) -> dict[str, str]:
    password_file = root / "nats.password"
    password_file.write_text(NATS_PASSWORD + "\n")
    password_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_") and k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    env.update(
        DYN_DISCOVERY_BACKEND="etcd",
        ETCD_ENDPOINTS=etcd.endpoint,
        DYN_EVENT_PLANE="nats",
        NATS_SERVER=nats.url,
        DYN_LEASE_TTL="3",
        DYN_ETCD_CA_FILE=certs.ca,
        DYN_ETCD_CERT_FILE=certs.node_cert,
        DYN_ETCD_KEY_FILE=certs.node_key,
        DYN_ETCD_USER=ETCD_USER,
        DYN_ETCD_PASSWORD=ETCD_PASSWORD,
        DYN_NATS_CA_FILE=certs.ca,
        DYN_NATS_CERT_FILE=certs.node_cert,
        DYN_NATS_KEY_FILE=certs.node_key,
        DYN_NATS_USER=NATS_USER,
        DYN_NATS_PASSWORD_FILE=str(password_file),
        DYN_CLUSTER_TOKEN_FILE=certs.token_file,
        DYN_TLS_CA_FILE=certs.ca,
        DYN_TLS_CERT_FILE=certs.node_cert,
        DYN_TLS_KEY_FILE=certs.node_key,
        DYN_TLS_REQUIRE_CLIENT_CERT="1",
    )
    return env


class SecureCluster:
    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.worker_port = free_port()
        self.http_port = free_port()
        self.worker = Proc(
            "worker",
            [*CLI, "--role", "agg", "--engine", "mocker", "--model", "tiny", "--speedup-ratio", "20",
             "--system-port", str(self.worker_port)],
            env,
            root,
        )
        self.frontend = Proc(
            "frontend", [*CLI, "--role", "frontend", "--http-port", str(self.http_port), "--worker-wait", "5"], env, root
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self) -> None:
        def ready() -> bool:
            for proc in (self.worker, self.frontend):
                if not proc.alive():
                    raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
            body = get_json(self.url + "/health")
            return any(w["status"] == "ready" for m in body.get("models", []) for w in m["workers"])

        wait_until(ready, 90, interval=0.2, what="a secured frontend with a ready worker")

    def stop(self) -> None:
        for proc in (self.frontend, self.worker):
            proc.stop()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, cluster_certs: ClusterCerts, secure_etcd: EtcdServer, secure_nats: NatsServer
) -> Iterator[SecureCluster]:
    root = tmp_path_factory.mktemp("secure-cluster")
    c = SecureCluster(root, secure_env(cluster_certs, secure_etcd, secure_nats, root))
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def ctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_chat_completion_through_the_locked_cluster(cluster: SecureCluster) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello over TLS"}], "max_tokens": 8,
            "ignore_eos": True}
    resp = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    chat = resp.json()
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 8
    assert "security=mtls+token" in cluster.worker.log()


def test_dynamoctl_with_the_cluster_settings_operates_the_worker(cluster: SecureCluster) -> None:
    status = ctl(cluster.env, "status", "--json")
    assert status.returncode == 0, status.stderr
    workers = [r for r in json.loads(status.stdout) if r["component"] == "backend"]
    assert len(workers) == 1 and workers[0]["status"] == "ready"
    cleared = ctl(cluster.env, "clear-kv", workers[0]["id"], "--json")
    assert cleared.returncode == 0, cleared.stderr


@pytest.mark.parametrize(
    ("missing", "needle"),
    [(("DYN_CLUSTER_TOKEN_FILE",), "cluster token"), (("DYN_TLS_CERT_FILE", "DYN_TLS_KEY_FILE"), "TLS")],
)
def test_dynamoctl_without_token_or_certificate_is_refused(
    cluster: SecureCluster, missing: tuple[str, ...], needle: str
) -> None:
    worker_id = next(r["id"] for r in json.loads(ctl(cluster.env, "status", "--json").stdout) if r["component"] == "backend")
    env = {k: v for k, v in cluster.env.items() if k not in missing}
    res = ctl(env, "clear-kv", worker_id)
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("dynamoctl: error: ") and needle in lines[0], res.stderr


def test_refusals_are_counted_by_the_worker(cluster: SecureCluster) -> None:
    env = {k: v for k, v in cluster.env.items() if k != "DYN_CLUSTER_TOKEN_FILE"}
    worker_id = next(r["id"] for r in json.loads(ctl(cluster.env, "status", "--json").stdout) if r["component"] == "backend")
    assert ctl(env, "clear-kv", worker_id).returncode == 1
    token = Path(cluster.env["DYN_CLUSTER_TOKEN_FILE"]).read_text().strip()  # the worker's /metrics is for members
    metrics = httpx.get(
        f"http://127.0.0.1:{cluster.worker_port}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=5
    ).text
    counted = [
        line for line in metrics.splitlines()
        if line.startswith("dynamo_component_request_plane_unauthenticated_total") and 'reason="missing_token"' in line
    ]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, metrics
