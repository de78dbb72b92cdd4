"""The planner's connectors, each against the real thing it drives.

- virtual: real etcd; counts ready workers from real instance records, writes ``DesiredReplicas``,
  reads back an orchestrator's ``ScaledReplicas`` and reports a decision nobody acknowledged.
- local: a real ``dynamod up --accept-scaling`` supervisor: scale-up starts worker processes that
  count once they serve; scale-down drains workers with requests in flight, every one of which
  completes, then stops them for good.
- ssh: the private sshd the ``dynamoctl cluster`` tests use; the inventory's worker roles are
  started and stopped over SSH, a removed one drained first.
- kubernetes: no API server runs here. lightkube talks to a local HTTP server that replays a
  written exchange of the apps/v1 scale subresource (``tests/fixtures/recorded/k8s_scale``), and
  fails on any request that is not the next one expected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamod.daemon.planner.connectors.factory import DEFAULT_DEPLOYMENTS
from dynamod.daemon.planner.connectors.kubernetes import KubernetesConnector
from dynamod.daemon.planner.connectors.local import LocalConnector
from dynamod.daemon.planner.connectors.ssh import SshConnector
from dynamod.daemon.planner.connectors.virtual import VirtualConnector
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.instance import STATUS_DRAINING
from dynamod.shared.protocol.keys import planner_desired_key, planner_scaled_key
from dynamod.shared.protocol.llm import EngineOutput
from dynamod.shared.protocol.planner import DesiredReplicas, ScaledReplicas
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import EtcdServer, free_port
from tests.integration.dynamoctl.test_cluster_ssh import (  # noqa: F401  (sshd: the fixture)
    DYNAMOD,
    SSHD,
    PrivateSshd,
    role_toml,
    sshd,
    write_inventory,
)
from tests.integration.frontend.test_frontend_support import clean_env
from tests.integration.worker.test_worker_daemon import request

pytestmark = pytest.mark.timeout(300)
RECORDED = Path(__file__).resolve().parents[2] / "fixtures" / "recorded" / "k8s_scale"


async def until(predicate: Any, timeout: float, what: str) -> Any:
    """Polls an async or plain predicate until it returns something truthy, within ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def _echo(_body: Any, _ctx: Any) -> AsyncIterator[Any]:
    yield {"ok": True}


# -- virtual, against etcd -------------------------------------------------------------------------


@pytest.fixture
async def etcd_runtime(etcd_server: EtcdServer) -> AsyncIterator[DistributedRuntime]:
    settings = RuntimeSettings(discovery_backend="etcd", etcd_endpoints=[etcd_server.endpoint], lease_ttl_s=3)
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        yield rt
    finally:
        await rt.shutdown(grace_s=0)


async def test_virtual_connector_against_etcd(etcd_runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dynamod.daemon.planner.connectors")
    rt = etcd_runtime
    ns = rt.namespace()
    # Workers as discovery shows them: two agg (one draining), one prefill; the control endpoints
    # of the same workers are not workers.
    await ns.component("backend").endpoint("generate").serve(_echo, role="agg")
    await ns.component("backend").endpoint("drain").serve(_echo, role="agg")
    await ns.component("backend").endpoint("generate").serve(_echo, role="agg", lease=await rt.create_lease(),
                                                             status=STATUS_DRAINING)
    await ns.component("prefill").endpoint("generate").serve(_echo, role="prefill", lease=await rt.create_lease())

    connector = VirtualConnector(rt.store, "dynamo", ack_timeout_s=0.5)
    await connector.start()
    try:
        assert await connector.ready_replicas() == {"prefill": 1, "decode": 0, "agg": 1}

        await connector.set_replicas({"agg": 3}, decision_id=7)
        raw = await rt.store.get(planner_desired_key("dynamo"))
        assert raw is not None
        written = msgspec.json.decode(raw, type=DesiredReplicas)
        assert written.replicas == {"agg": 3} and written.decision_id == 7 and written.planner == "virtual"
        await connector.set_replicas({"agg": 3}, decision_id=8)  # the same counts: not rewritten
        assert await rt.store.get(planner_desired_key("dynamo")) == raw

        # The orchestrator answers: the connector reads it back and the decision is settled.
        scaled = ScaledReplicas(decision_id=7, replicas={"agg": 3}, by="test-orchestrator")
        await rt.store.put(planner_scaled_key("dynamo"), msgspec.json.encode(scaled))
        await until(lambda: connector.pending is None, 10, "the acknowledgement")
        assert connector.last_scaled == scaled
        assert any("scaling acknowledged" in r.getMessage() and "test-orchestrator" in r.getMessage() for r in caplog.records)

        # Nobody answers the next one: it is reported once the timeout passes.
        await connector.set_replicas({"agg": 2}, decision_id=9)
        await until(lambda: connector.pending is not None and connector.pending.timed_out, 10, "the ack timeout")
        assert any("scaling not acknowledged" in r.getMessage() and "decision_id=9" in r.getMessage() for r in caplog.records)

        # A restarted planner sees what was asked and does not rewrite the same counts.
        again = VirtualConnector(rt.store, "dynamo")
        await again.start()
        assert again.last_written is not None and again.last_written.decision_id == 9
        await again.close()
    finally:
        await connector.close()


# -- local, against a real `dynamod up` ------------------------------------------------------------------


class UpProcess:
    """``dynamod up`` in the background, its output collected."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.file_kv = tmp_path / "discovery"
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(self.port),
            "--file-kv", str(self.file_kv), "--log-dir", str(tmp_path / "logs"), *extra,
        ]
        self.proc = subprocess.Popen(cmd, env=clean_env(self.file_kv), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),  # type: ignore[union-attr]
                                        daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


async def _long_streams(rt: DistributedRuntime, count: int, max_tokens: int) -> tuple[list[asyncio.Task[int]], list[int]]:
    """One long request admitted on each of ``count`` agg workers; tasks return the tokens received."""
    client = await rt.namespace().component("backend").endpoint("generate").client()
    insts = await client.wait_for_instances(count, timeout=30)
    tasks: list[asyncio.Task[int]] = []
    for n, inst in enumerate(insts):
        stream = client.stream_to(inst, request(f"long-{n}", list(range(50 + n, 90 + n)), max_tokens=max_tokens))
        first = msgspec.convert(await anext(stream), EngineOutput)  # admitted: in flight on that worker

        async def rest(stream: AsyncIterator[Any] = stream, first: EngineOutput = first) -> int:
            return len(first.token_ids) + sum([len(msgspec.convert(o, EngineOutput).token_ids) async for o in stream])

        tasks.append(asyncio.create_task(rest()))
    return tasks, [i.pid for i in insts]


async def test_local_connector_scales_a_dynamod_up_cluster(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, "--accept-scaling", "--workers", "1", "--max-workers", "3", "--speedup-ratio", "4",
                   "--worker-args", "--lease-ttl 3")
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(up.file_kv), event_plane="zmq", lease_ttl_s=3)
    rt = await DistributedRuntime.create(settings, events=False)
    connector = LocalConnector(rt.store, "dynamo", ack_timeout_s=120, supervisor_wait_s=60)
    try:
        await connector.start()
        assert connector.scaler is not None and connector.scaler.max_replicas == {"agg": 3}
        await until(connector.ready_replicas, 60, "the first worker")

        # Scale-up: two more processes, counted once they serve; the supervisor acknowledges.
        await connector.set_replicas({"agg": 3}, decision_id=1)
        await until(lambda: connector.last_scaled is not None and connector.last_scaled.decision_id == 1, 120, "ack 1")
        assert connector.last_scaled is not None
        assert connector.last_scaled.replicas == {"agg": 3} and connector.last_scaled.error == ""
        assert (await connector.ready_replicas())["agg"] == 3

        # Scale-down with a request in flight on every worker: two are drained, every request completes.
        tasks, pids = await _long_streams(rt, 3, max_tokens=300)
        await connector.set_replicas({"agg": 1}, decision_id=2)
        await until(lambda: connector.last_scaled is not None and connector.last_scaled.decision_id == 2, 120, "ack 2")
        assert connector.last_scaled is not None and connector.last_scaled.replicas == {"agg": 1}
        assert [await t for t in tasks] == [300, 300, 300]
        assert sum(_pid_alive(p) for p in pids) == 1  # the two removed processes are gone
        assert (await connector.ready_replicas())["agg"] == 1
        assert up.output.count("child retired") == 2 and "restarting it" not in up.output

        # Above the supervisor's budget: clamped to it.
        await connector.set_replicas({"agg": 9}, decision_id=3)
        await until(lambda: connector.last_scaled is not None and connector.last_scaled.decision_id == 3, 120, "ack 3")
        assert connector.last_scaled is not None and connector.last_scaled.replicas == {"agg": 3}
    finally:
        await connector.close()
        await rt.shutdown(grace_s=0)
        code = up.stop()
    assert code == 0, up.output[-3000:]


async def test_local_connector_without_a_supervisor_says_so(tmp_path: Path) -> None:
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(tmp_path / "kv"), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        with pytest.raises(ConfigError, match="no `dynamod up` supervisor accepts scaling"):
            await LocalConnector(rt.store, "dynamo", supervisor_wait_s=0.5).start()
    finally:
        await rt.shutdown(grace_s=0)


# -- ssh, against the private sshd --------------------------------------------------------------------------


def _ssh_inventory(path: Path, server: PrivateSshd, file_kv: Path, workdir: Path) -> Path:
    args = ["--engine", "mocker", "--model", "tiny", "--speedup-ratio", "4", "--lease-ttl", "3"]
    roles = "".join(role_toml(f"agg-{i}", args, free_port()) for i in range(2))
    return write_inventory(path, server, file_kv, workdir, roles=roles)


@pytest.mark.skipif(not os.path.exists(SSHD), reason="needs openssh-server (/usr/sbin/sshd)")
@pytest.mark.skipif(not DYNAMOD.exists(), reason=f"needs the dynamod entry point at {DYNAMOD}")
async def test_ssh_connector_starts_and_stops_inventory_roles(sshd: PrivateSshd, tmp_path: Path) -> None:  # noqa: F811
    file_kv = tmp_path / "kv"
    inv = _ssh_inventory(tmp_path / "inv.toml", sshd, file_kv, tmp_path / "work")
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(file_kv), event_plane="zmq", lease_ttl_s=3)
    rt = await DistributedRuntime.create(settings, events=False)
    connector = SshConnector(rt, "dynamo", str(inv), drain_timeout_s=60)
    try:
        await connector.start()
        assert [s.label for s in connector.slots["agg"]] == ["local/agg-0", "local/agg-1"]
        await connector.set_replicas({"agg": 2}, decision_id=1)
        await until(connector.idle.is_set, 60, "both roles started")
        assert connector.last_error == ""
        await until(lambda: _ready_agg(connector, 2), 90, "two ready workers")

        tasks, pids = await _long_streams(rt, 2, max_tokens=300)
        await connector.set_replicas({"agg": 1}, decision_id=2)
        await until(connector.idle.is_set, 120, "the last role stopped")
        assert connector.last_error == ""
        assert [await t for t in tasks] == [300, 300]  # the drained worker finished its request
        assert sum(_pid_alive(p) for p in pids) == 1
        running = await connector._running(connector.slots["agg"])
        assert [s.label for s in running] == ["local/agg-0"]  # the last slot went first
        await until(lambda: _ready_agg(connector, 1), 30, "one ready worker")

        await connector.set_replicas({"agg": 1}, decision_id=3)  # the same again: nothing to do
        assert connector.idle.is_set()
    finally:
        try:
            await connector.set_replicas({"agg": 0}, decision_id=99)
            await until(connector.idle.is_set, 120, "every role stopped")
        finally:
            await connector.close()
            await rt.shutdown(grace_s=0)


async def _ready_agg(connector: SshConnector, n: int) -> bool:
    return (await connector.ready_replicas())["agg"] == n


# -- kubernetes, against a replayed exchange ------------------------------------------------------------


class ReplayServer:
    """Answers each request with the next recorded exchange, if it is the one expected."""

    def __init__(self, exchanges: list[dict[str, Any]]) -> None:
        self.exchanges = list(exchanges)
        self.errors: list[str] = []
        self.seen: list[tuple[str, str]] = []
        lock = threading.Lock()
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                with lock:
                    replay.seen.append((self.command, path))
                    expected = replay.exchanges.pop(0) if replay.exchanges else None
                    problem = replay._mismatch(expected, self.command, path, self.headers.get("Content-Type"), body)
                    if problem:
                        replay.errors.append(problem)
                if problem or expected is None:
                    status, payload = 500, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                            "message": problem, "code": 500}
                else:
                    status, payload = expected["status"], expected["response"]
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_PUT = _answer

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def _mismatch(expected: dict[str, Any] | None, method: str, path: str, ctype: str | None, body: bytes) -> str:
        if expected is None:
            return f"unexpected request {method} {path}: the exchange is over"
        if (method, path) != (expected["method"], expected["path"]):
            return f"expected {expected['method']} {expected['path']}, got {method} {path}"
        want = expected.get("request")
        if want is not None:
            if (ctype or "").split(";")[0] != want["content_type"]:
                return f"{method} {path}: content type {ctype!r}, expected {want['content_type']!r}"
            if json.loads(body or b"null") != want["body"]:
                return f"{method} {path}: body {body!r}, expected {want['body']!r}"
        return ""

    def __enter__(self) -> ReplayServer:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def _kubeconfig(path: Path, server: str, namespace: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "replay",
        "clusters": [{"name": "replay", "cluster": {"server": server}}],
        "users": [{"name": "planner", "user": {"token": "recorded"}}],
        "contexts": [{"name": "replay", "context": {"cluster": "replay", "user": "planner", "namespace": namespace}}],
    }))
    return path


@pytest.fixture
def recorded_scale() -> Iterator[dict[str, Any]]:
    yield json.loads((RECORDED / "scale_agg.json").read_text())


async def test_kubernetes_connector_scales_through_the_scale_subresource(recorded_scale: dict[str, Any], tmp_path: Path) -> None:
    with ReplayServer(recorded_scale["exchanges"]) as api:
        config = _kubeconfig(tmp_path / "kubeconfig", api.url, recorded_scale["namespace"])
        connector = KubernetesConnector(deployments=DEFAULT_DEPLOYMENTS, kubeconfig=str(config),
                                        sa_namespace_file=str(tmp_path / "no-service-account"))
        try:
            await connector.start()
            assert connector.namespace == "dynamod" and connector.managed == {"agg": "dynamod-agg"}
            assert await connector.ready_replicas() == {"agg": 1}
            await connector.set_replicas({"agg": 3}, decision_id=1)
            assert await connector.ready_replicas() == {"agg": 1}  # pods starting: not counted yet
            assert await connector.ready_replicas() == {"agg": 3}
            await connector.set_replicas({"agg": 3}, decision_id=2)  # already there: read, no patch
            await connector.set_replicas({"agg": 2}, decision_id=3)
            assert await connector.ready_replicas() == {"agg": 2}
            with pytest.raises(ConfigError, match="have no deployment here"):
                await connector.set_replicas({"decode": 2}, decision_id=4)
        finally:
            await connector.close()
    assert api.errors == [] and api.exchanges == [], (api.errors, api.exchanges)


async def test_kubernetes_connector_names_the_missing_rbac(tmp_path: Path) -> None:
    recorded = json.loads((RECORDED / "scale_forbidden.json").read_text())
    with ReplayServer(recorded["exchanges"]) as api:
        config = _kubeconfig(tmp_path / "kubeconfig", api.url, recorded["namespace"])
        connector = KubernetesConnector(deployments=DEFAULT_DEPLOYMENTS, kubeconfig=str(config),
                                        sa_namespace_file=str(tmp_path / "none"))
        try:
            await connector.start()
            with pytest.raises(ConfigError, match="needs get on deployments and get/patch on deployments/scale"):
                await connector.set_replicas({"agg": 2}, decision_id=1)
        finally:
            await connector.close()
    assert api.errors == [] and api.exchanges == []
