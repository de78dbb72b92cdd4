"""A cluster that really spans hosts: etcd and NATS, a frontend and two workers, each in its own
network namespace with its own address (``tests/fixtures/netns.py``), reached over a bridge.

What a single host hides and this catches: a listener that advertises 127.0.0.1 or 0.0.0.0 (ZMQ
publishers, the request plane, status servers, the frontend's record), a frontend that opens the
tokenizer at a path on the worker's disk (here each worker's model is a private copy, deleted once
the worker is up), and a link that goes silent mid-stream (``ip link set ... down``: no RST, no FIN)
instead of a process that dies. Run for both event planes: KV events reach the frontend's KV router
over NATS and over ZMQ.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dynamod.daemon.models.local import TINY_MODEL_DIR
from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.protocol.keys import MDC_FILES_ROOT, event_channels_prefix, instances_prefix, mdc_prefix
from tests.fixtures import netns
from tests.fixtures.servers import _find_binary, wait_until
from tests.integration.frontend.test_frontend_support import Proc

_NO_NETNS = netns.unavailable_reason()
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(_NO_NETNS is not None, reason=f"no network namespaces here: {_NO_NETNS}"),
]

REQUEST_PLANE_PORT = 7001  # pinned: every worker's instance record must name it
SYSTEM_PORT = 9100
HTTP_PORT = 8000
CLI = [sys.executable, "-m", "dynamod.daemon.cli"]


@dataclass
class Infra:
    net: netns.NetnsNetwork
    hosts: dict[str, netns.Host]
    root: Path
    procs: list[subprocess.Popen[bytes]]

    @property
    def etcd(self) -> str:
        return f"http://{self.hosts['infra'].address}:2379"

    @property
    def nats(self) -> str:
        return f"nats://{self.hosts['infra'].address}:4222"


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as resp:
        return resp.status == 200


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Infra]:
    root = tmp_path_factory.mktemp("netns")
    net = netns.NetnsNetwork.create()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        hosts = {name: net.add_host(name, octet) for name, octet in (("infra", 1), ("fe", 2), ("w1", 11), ("w2", 12))}
        infra_host = hosts["infra"]
        a = infra_host.address
        log = open(root / "etcd.log", "wb")  # noqa: SIM115 - handed to the child
        procs.append(subprocess.Popen(infra_host.exec_argv([
            _find_binary("etcd"), "--name", "infra", "--data-dir", str(root / "etcd"),
            "--listen-client-urls", f"http://{a}:2379", "--advertise-client-urls", f"http://{a}:2379",
            "--listen-peer-urls", f"http://{a}:2380", "--initial-advertise-peer-urls", f"http://{a}:2380",
            "--initial-cluster", f"infra=http://{a}:2380", "--log-level", "error",
        ]), stdout=log, stderr=log))
        log = open(root / "nats.log", "wb")  # noqa: SIM115 - handed to the child
        procs.append(subprocess.Popen(infra_host.exec_argv([
            _find_binary("nats-server"), "-a", a, "-p", "4222", "-m", "8222", "-js", "-sd", str(root / "js"),
        ]), stdout=log, stderr=log))
        wait_until(lambda: _healthy(f"http://{a}:2379/health"), 30, what="etcd in its namespace")
        wait_until(lambda: _healthy(f"http://{a}:8222/healthz"), 30, what="nats-server in its namespace")
        yield Infra(net, hosts, root, procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        net.cleanup()


@dataclass
class Deployment:
    infra: Infra
    plane: str
    namespace: str
    workers: dict[str, Proc]
    frontend: Proc

    @property
    def url(self) -> str:
        return f"http://{self.infra.hosts['fe'].address}:{HTTP_PORT}"

    def records(self, prefix: str) -> dict[str, bytes]:
        async def read() -> dict[str, bytes]:
            store = EtcdStore([self.infra.etcd])
            await store.start()
            try:
                return await store.get_prefix(prefix)
            finally:
                await store.close()

        return asyncio.run(read())

    def worker_ids(self) -> dict[str, str]:
        """Host name -> hex instance id of its generate endpoint."""
        out = {}
        for raw in self.records(instances_prefix(self.namespace, "backend", "generate")).values():
            rec = json.loads(raw)
            for name in self.workers:
                if rec["address"].startswith(self.infra.hosts[name].address + ":"):
                    out[name] = f"{rec['instance_id']:x}"
        return out


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DYN_") and k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}


def _ready_workers(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return 0
    models = [m for m in body.get("models", []) if m["model"] == "tiny"]
    return sum(1 for m in models for w in m["workers"] if w["status"] == "ready")


@pytest.fixture(scope="module", params=["nats", "zmq"])
def deployment(request: pytest.FixtureRequest, infra: Infra) -> Iterator[Deployment]:
    plane = request.param
    namespace = f"mn{plane}"
    common = ["--namespace", namespace, "--discovery-backend", "etcd", "--etcd-endpoints", infra.etcd,
              "--nats-server", infra.nats, "--event-plane", plane, "--lease-ttl", "10"]
    logs = infra.root / plane
    logs.mkdir()
    workers: dict[str, Proc] = {}
    frontend: Proc | None = None
    try:
        for name in ("w1", "w2"):
            host = infra.hosts[name]
            model = infra.root / plane / f"{name}-models" / "private-tiny"  # a path only this worker has
            shutil.copytree(TINY_MODEL_DIR, model)
            # w1 binds every interface: what it advertises must still be its own address.
            bind = "0.0.0.0" if name == "w1" else host.address
            argv = [*CLI, "--role", "agg", "--engine", "mocker", "--model", str(model), "--served-model-name", "tiny",
                    "--block-size", "16", "--speedup-ratio", "1", *common, "--host", bind,
                    "--request-plane-port", str(REQUEST_PLANE_PORT),
                    "--system-host", bind, "--system-port", str(SYSTEM_PORT)]
            workers[name] = Proc(f"{name}", host.exec_argv(argv), _env(), logs)

        def cards_published() -> bool:
            for proc in workers.values():
                assert proc.alive(), proc.log()
            return len(asyncio.run(_count(infra.etcd, mdc_prefix(namespace)))) >= 2

        wait_until(cards_published, 90, interval=0.2, what="both workers' model cards")
        for name in workers:  # the frontend must not need them: the cards carry the tokenizer
            shutil.rmtree(infra.root / plane / f"{name}-models")
        fe = infra.hosts["fe"]
        argv = [*CLI, "--role", "frontend", *common, "--http-host", "0.0.0.0", "--http-port", str(HTTP_PORT),
                "--router-mode", "kv", "--host", fe.address,
                "--request-plane-heartbeat-interval", "0.5", "--request-plane-heartbeat-timeout", "2"]
        frontend = Proc("frontend", fe.exec_argv(argv), _env(), logs)
        url = f"http://{fe.address}:{HTTP_PORT}"

        def ready() -> bool:
            assert frontend is not None and frontend.alive(), frontend.log() if frontend else ""
            return _ready_workers(url) >= 2

        wait_until(ready, 90, interval=0.2, what="the frontend in its namespace with both workers")
        yield Deployment(infra, plane, namespace, workers, frontend)
    finally:
        if frontend is not None:
            frontend.stop()
        for proc in workers.values():
            proc.stop()


async def _count(endpoint: str, prefix: str) -> dict[str, bytes]:
    store = EtcdStore([endpoint])
    await store.start()
    try:
        return await store.get_prefix(prefix)
    finally:
        await store.close()


def test_every_listener_advertises_its_host(deployment: Deployment) -> None:
    hosts = deployment.infra.hosts
    texts = []
    for name in ("w1", "w2"):
        addr = hosts[name].address
        records = [json.loads(v) for v in deployment.records(instances_prefix(deployment.namespace, "backend")).values()]
        mine = [r for r in records if r["address"] == f"{addr}:{REQUEST_PLANE_PORT}"]
        assert mine, f"no instance of {name} advertises {addr}:{REQUEST_PLANE_PORT}: {records}"
        assert all(r["system_url"] == f"http://{addr}:{SYSTEM_PORT}" for r in mine)
        texts += [json.dumps(r) for r in mine]
    front = [json.loads(v) for v in deployment.records(instances_prefix(deployment.namespace, "frontend")).values()]
    assert [r["address"] for r in front] == [f"{hosts['fe'].address}:{HTTP_PORT}"]
    texts += [json.dumps(r) for r in front]
    if deployment.plane == "zmq":
        # Workers' KV events and load, and the frontend's own router-sync publishers.
        channels = [json.loads(v)["address"] for v in deployment.records(event_channels_prefix(deployment.namespace)).values()]
        own = {f"tcp://{hosts[name].address}" for name in ("w1", "w2", "fe")}
        assert channels and {a.rsplit(":", 1)[0] for a in channels} == own, channels
        texts += channels
    assert not [t for t in texts if "127.0.0.1" in t or "0.0.0.0" in t]
    cards = [json.loads(v) for v in deployment.records(mdc_prefix(deployment.namespace)).values()]
    assert all(c["model_files"]["sha256"] for c in cards)
    copies = deployment.records(f"{MDC_FILES_ROOT}{deployment.namespace}/{cards[0]['model_files']['sha256']}/copies/")
    assert 1 <= len(copies) <= 2


def _metric(url: str, pattern: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(pattern, text))


def test_kv_events_reach_the_router_and_the_tokenizer_came_from_discovery(deployment: Deployment) -> None:
    url = deployment.url
    # A chat request needs the chat template: the workers' model directories are gone, so it came
    # from the cards' files in etcd.
    with httpx.Client(base_url=url, timeout=30) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello across hosts"}], "max_tokens": 4,
        })
        assert chat.status_code == 200, chat.text
        prompt = "document across namespaces: " + " ".join(f"word{j}" for j in range(120))
        served, cached = [], []
        for _ in range(4):
            r = client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
            })
            assert r.status_code == 200, r.text
            served.append(r.headers["x-dynamo-worker-instance-id"])
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # The KV router learned where the prompt's blocks are from the workers' KV events.
    assert len(set(served)) == 1, served
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    stored = r'dynamo_router_kv_events_total\{event_type="stored",[^}]*\} ([0-9.]+)'
    assert _metric(url, stored) >= 1, "the router saw no KV events"


def test_link_down_mid_stream_migrates_and_the_worker_comes_back(deployment: Deployment) -> None:
    net, hosts = deployment.infra.net, deployment.infra.hosts
    ids = deployment.worker_ids()
    assert set(ids) == {"w1", "w2"}, ids
    max_tokens = 300
    migrations_before = _metric(deployment.url, r"dynamo_frontend_model_migration_total\{[^}]*\} ([0-9.]+)")
    tokens = 0
    finish = None
    cut: str | None = None
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": f"a long story over a flaky network ({deployment.plane})",
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "return_token_ids": True,
        }) as resp:
            assert resp.status_code == 200
            first = resp.headers["x-dynamo-worker-instance-id"]
            victim = next(name for name, iid in ids.items() if int(iid, 16) == int(first, 16))
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices", []):
                    tokens += len(choice.get("token_ids") or [])
                    finish = choice.get("finish_reason") or finish
                if cut is None and tokens >= 10:
                    net.link_down(hosts[victim])  # silence, mid-stream
                    cut = victim
    try:
        assert cut is not None, "the stream ended before the link could be cut"
        assert tokens == max_tokens and finish == "length", (tokens, finish)
        assert _metric(deployment.url, r"dynamo_frontend_model_migration_total\{[^}]*\} ([0-9.]+)") > migrations_before
    finally:
        if cut is not None:
            net.link_up(hosts[cut])
    # Back on the network within its lease: the worker serves again (addressed directly).
    def serves_again() -> bool:
        r = httpx.post(deployment.url + "/v1/completions", timeout=10, headers={"x-dynamo-worker-instance-id": ids[cut]},
                       json={"model": "tiny", "prompt": "are you back?", "max_tokens": 2, "ignore_eos": True})
        return r.status_code == 200

    wait_until(serves_again, 45, interval=0.5, what=f"{cut} serving again after its link came back")
    assert deployment.workers[cut].alive()


def test_a_worker_advertising_loopback_with_remote_discovery_is_warned(infra: Infra) -> None:
    """Issue 24 item 9: a worker pointed at etcd on another host but left on the default --host
    advertises 127.0.0.1, which a frontend elsewhere dials on itself. It says so at start; a worker
    given its own address (the README's recipe) does not."""
    logs = infra.root / "loopback-warning"
    logs.mkdir()
    common = ["--role", "agg", "--engine", "mocker", "--model", "tiny", "--namespace", "mnwarn",
              "--discovery-backend", "etcd", "--etcd-endpoints", infra.etcd, "--event-plane", "zmq"]
    host = infra.hosts["w2"]
    loopback = Proc("default-host", host.exec_argv([*CLI, *common]), _env(), logs)
    reachable = Proc("own-host", host.exec_argv([*CLI, *common, "--host", host.address]), _env(), logs)
    try:
        for proc in (loopback, reachable):
            wait_until(lambda p=proc: "request plane serving" in p.log() or not p.alive(), 60, what=f"{proc.name} serving")
            assert proc.alive(), proc.log()
        warning = [line for line in loopback.log().splitlines() if "request plane unreachable from other hosts" in line]
        assert len(warning) == 1, loopback.log()
        assert "address=127.0.0.1:" in warning[0] and infra.etcd in warning[0] and "--host" in warning[0]
        assert "unreachable from other hosts" not in reachable.log()
    finally:
        loopback.stop()
        reachable.stop()
