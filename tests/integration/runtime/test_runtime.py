"""The distributed runtime end to end: real child processes, real discovery backends, TCP plane."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.errors import NoInstancesError
from dynamod.shared.runtime.distributed import DistributedRuntime

HELPER = [sys.executable, "-m", "tests.integration.runtime.helpers_runtime.serve_counter"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class Child:
    def __init__(self, env: dict[str, str], *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*HELPER, *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.proc.kill()
            raise RuntimeError(f"child failed to start: {line} {self.proc.stderr.read()}")
        self.instance_id = int(line[1], 16)
        self.status_url = line[2] if len(line) > 2 else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def backend_env(backend: str, tmp_path, etcd=None, ttl: float = 2.0) -> tuple[dict[str, str], RuntimeSettings]:
    env = dict(os.environ, DYN_DISCOVERY_BACKEND=backend, DYN_LEASE_TTL=str(ttl), DYN_SYSTEM_PORT="0", DYN_EVENT_PLANE="zmq")
    settings = RuntimeSettings(discovery_backend=backend, lease_ttl_s=ttl, event_plane="zmq")
    if backend == "file":
        env["DYN_FILE_KV"] = settings.file_kv = str(tmp_path / "kv")
    else:
        env["ETCD_ENDPOINTS"] = etcd.endpoint
        settings.etcd_endpoints = [etcd.endpoint]
    return env, settings


@pytest.fixture(params=["file", "etcd"])
def backend(request, tmp_path) -> Iterator[tuple[dict[str, str], RuntimeSettings]]:
    if request.param == "etcd":
        etcd = request.getfixturevalue("etcd_server")
        yield backend_env("etcd", tmp_path, etcd)
    else:
        yield backend_env("file", tmp_path)


async def test_serve_discover_stream_across_processes(backend) -> None:
    env, settings = backend
    child = Child(env)
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        client = await rt.namespace().component("echo").endpoint("counter").client()
        [inst] = await client.wait_for_instances(1, timeout=5)
        assert inst.instance_id == child.instance_id and inst.role == "test"
        got = [item["i"] async for item in client.generate({"n": 10_000})]
        assert got == list(range(10_000))
        # The status server reports ready and exports the component metrics.
        async with httpx.AsyncClient(timeout=2) as http:
            assert (await http.get(child.status_url + "/health")).status_code == 200
            text = (await http.get(child.status_url + "/metrics")).text
        assert 'dynamo_component_requests_total{dynamo_component="echo",dynamo_endpoint="counter",dynamo_namespace="dynamo"} 1.0' in text
        # A clean stop deregisters at once.
        assert child.stop() == 0
        await client.instance_set.wait_for(lambda insts: not insts, timeout=3)
        with pytest.raises(NoInstancesError):
            client.pick()
    finally:
        child.kill()
        await rt.shutdown(1)


async def test_killed_process_leaves_within_lease_ttl(backend) -> None:
    env, settings = backend
    child = Child(env)
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        client = await rt.namespace().component("echo").endpoint("counter").client()
        await client.wait_for_instances(1, timeout=5)
        child.kill()  # SIGKILL: no deregistration; only the lease TTL (2 s) removes it
        loop = asyncio.get_running_loop()
        start = loop.time()
        await client.instance_set.wait_for(lambda insts: not insts, timeout=settings.lease_ttl_s + 3)
        assert loop.time() - start <= settings.lease_ttl_s + 2.5
    finally:
        child.kill()
        await rt.shutdown(1)


async def test_sigterm_lets_inflight_stream_finish(tmp_path) -> None:
    env, settings = backend_env("file", tmp_path)
    child = Child(env)
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        client = await rt.namespace().component("echo").endpoint("counter").client()
        await client.wait_for_instances(1, timeout=5)
        stream = client.generate({"n": 20, "delay": 0.05})
        first = await anext(stream)
        child.proc.send_signal(signal.SIGTERM)
        rest = [item["i"] async for item in stream]
        assert [first["i"], *rest] == list(range(20))
        assert child.proc.wait(10) == 0
    finally:
        child.kill()
        await rt.shutdown(1)


async def test_status_server_not_ready_until_served(tmp_path) -> None:
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(tmp_path / "kv"), event_plane="zmq", system_port=0)
    rt = await DistributedRuntime.create(settings)
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            assert (await http.get(rt.status_url + "/live")).status_code == 200
            assert (await http.get(rt.status_url + "/health")).status_code == 503

            async def echo(body, ctx):
                yield body

            await rt.namespace().component("c").endpoint("e").serve(echo)
            assert (await http.get(rt.status_url + "/health")).status_code == 200
    finally:
        await rt.shutdown(1)
