"""A real local cluster for live console tests: one ``dynamod --role agg --engine mocker`` process
with N workers (each its own instance id), file discovery in a temp dir and ZMQ events.

Also the request side the tests need: a runtime of their own to send ``generate`` requests the way
a frontend does (round-robin over routable instances, or direct to one instance)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec

from dynamod.console.collectors.connection import ClusterConnection
from dynamod.console.settings import ConsoleSettings
from dynamod.console.state.cluster import ClusterState
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.protocol.instance import decode_instance
from dynamod.shared.protocol.keys import instances_prefix
from dynamod.shared.protocol.llm import PreprocessedRequest, StopConditions
from tests.fixtures.servers import wait_until

NAMESPACE = "dynamo"
BLOCK_TOKENS = 64  # the tiny model's KV block size in the mocker


class MockerCluster:
    def __init__(self, root: Path, workers: int = 3, *, discovery: str = "file", etcd: str | None = None, nats: str | None = None) -> None:
        self.root = root
        self.file_kv = str(root / "file-kv")
        self.workers = workers
        self.discovery = discovery
        self.etcd = etcd
        self.nats = nats
        self.log_path = root / "workers.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "dynamod.daemon.cli", "--role", "agg", "--engine", "mocker", "--model", "tiny",
                "--speedup-ratio", "10", "--num-workers", str(self.workers), "--system-port", "0",
                "--namespace", NAMESPACE, "--discovery-backend", self.discovery]  # the default lease TTL, as in production
        if self.discovery == "file":
            argv += ["--file-kv", self.file_kv, "--event-plane", "zmq"]
        else:
            argv += ["--etcd-endpoints", str(self.etcd), "--nats-server", str(self.nats), "--event-plane", "nats"]
        return argv

    def start(self, timeout: float = 90.0) -> MockerCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        (self.root / "adapters").mkdir(exist_ok=True)  # the workers' --lora-root (DYN_LORA_ROOT)
        env = dict(os.environ, DYN_LOG="info", DYN_LORA_ROOT=str(self.root / "adapters"))
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(self.root))

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker process exited rc={self.proc.returncode}:\n{self.log_tail()}")
            return len(self.instance_ids()) >= self.workers

        try:
            wait_until(ready, timeout, interval=0.2, what=f"{self.workers} mocker workers in discovery")
        except (TimeoutError, RuntimeError):
            self.stop()
            raise
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def read_instance_ids(self) -> list[int]:
        """Ids of the workers' generate endpoints, read straight from discovery."""
        store = make_store(self.discovery, etcd_endpoints=[self.etcd] if self.etcd else None, file_root=self.file_kv)
        await store.start()
        try:
            values = await store.get_prefix(instances_prefix(NAMESPACE, "backend", "generate"))
        finally:
            await store.close()
        return sorted(decode_instance(v).instance_id for v in values.values())

    def instance_ids(self) -> list[int]:
        """``read_instance_ids`` for synchronous callers (fixtures), outside any event loop."""
        return asyncio.run(self.read_instance_ids())

    def __enter__(self) -> MockerCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def runtime_settings(self) -> RuntimeSettings:
        s = RuntimeSettings()
        s.namespace = NAMESPACE
        s.discovery_backend = self.discovery
        s.file_kv = self.file_kv
        s.event_plane = "zmq" if self.discovery == "file" else "nats"
        if self.etcd:
            s.etcd_endpoints = [self.etcd]
        if self.nats:
            s.nats_server = self.nats
        return s.validate()


def request_body(model: str = "tiny", blocks: int = 2, max_tokens: int = 4, lora: str | None = None) -> dict[str, Any]:
    """A prompt of ``blocks`` full KV blocks of random tokens, so it is new to every worker's cache."""
    rnd = random.Random()
    tokens = [rnd.randrange(10, 2000) for _ in range(blocks * BLOCK_TOKENS + 3)]
    req = PreprocessedRequest(request_id=uuid.uuid4().hex, model=model, token_ids=tokens,
                              stop=StopConditions(max_tokens=max_tokens, ignore_eos=True), lora_name=lora)
    return msgspec.to_builtins(req)


@asynccontextmanager
async def collecting(file_kv: Path, namespace: str) -> AsyncIterator[ClusterState]:
    """The console's collectors (no frontend scrapes) on file discovery at ``file_kv``, once they
    are connected; yields the state they fill and stops them on the way out."""
    state = ClusterState()
    settings = ConsoleSettings(discovery="file", file_kv=str(file_kv), namespace=namespace, frontend_urls=[],
                               probe_interval_s=0.3, retry_max_s=1.0)
    conn = ClusterConnection(settings, state, scrape=False)
    task = asyncio.create_task(conn.run())
    try:
        await conn.wait_ready(20)
        yield state
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
