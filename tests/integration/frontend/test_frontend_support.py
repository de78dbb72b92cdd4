"""Support for the frontend integration tests (no tests here): real ``dynamod`` processes, i.e.
mocker workers and a frontend on file discovery in a temp directory, ZMQ events, loopback ports chosen at run time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import free_port, wait_until

CLI = [sys.executable, "-m", "dynamod.daemon.cli"]

# A tool's argument schema that the tool-calling tests (OpenAI and Anthropic) force the model to follow.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def clean_env(file_kv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_") and k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    env["DYN_FILE_KV"] = str(file_kv)
    return env


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def pid_gone(pid: int) -> bool:
    """True once every thread of ``pid`` has exited (a zombie waiting for its parent counts as gone).

    The main thread turns zombie as soon as it exits, while the process's other threads may still
    be dying and holding its files (a listening socket still takes connections): only when no
    thread is left running has the process let go of everything it had."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return False
        except OSError:
            continue  # that thread was reaped while we looked
    return True


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


class LocalCluster:
    """Workers and a frontend as real processes; ``stop()`` ends them all."""

    def __init__(self, root: Path, *, lease_ttl: float = 3.0, speedup: float = 10.0) -> None:
        self.root = root
        self.file_kv = root / "discovery"
        self.file_kv.mkdir(parents=True, exist_ok=True)
        self.env = clean_env(self.file_kv)
        self.lease_ttl = lease_ttl
        self.speedup = speedup
        self.workers: list[Proc] = []
        self.worker_status_ports: dict[str, int] = {}
        self.frontend: Proc | None = None
        self.http_port = 0
        self._count = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def runtime_flags(self) -> list[str]:
        return ["--discovery-backend", "file", "--event-plane", "zmq", "--file-kv", str(self.file_kv),
                "--lease-ttl", str(self.lease_ttl)]

    def start_worker(self, *extra: str) -> Proc:
        self._count += 1
        port = free_port()
        argv = [*CLI, "--role", "agg", "--engine", "mocker", "--model", "tiny", *self.runtime_flags(),
                "--speedup-ratio", str(self.speedup), "--system-port", str(port), *extra]
        proc = Proc(f"worker-{self._count}", argv, self.env, self.root)
        self.worker_status_ports[proc.name] = port
        self.workers.append(proc)
        return proc

    def start_frontend(self, *extra: str) -> Proc:
        self.http_port = free_port()
        argv = [*CLI, "--role", "frontend", *self.runtime_flags(), "--http-port", str(self.http_port),
                "--worker-wait", "3", *extra]
        self.frontend = Proc("frontend", argv, self.env, self.root)
        return self.frontend

    def health(self) -> dict:
        return get_json(self.url + "/health")

    def ready_workers(self, model: str = "tiny") -> list[str]:
        try:
            body = self.health()
        except (urllib.error.URLError, OSError, ValueError):
            return []
        for m in body.get("models", []):
            if m["model"] == model:
                return [w["instance_id"] for w in m["workers"] if w["status"] == "ready"]
        return []

    def wait_ready(self, workers: int, model: str = "tiny", timeout: float = 60.0) -> list[str]:
        def check() -> list[str] | None:
            for proc in [*self.workers, *( [self.frontend] if self.frontend else [])]:
                if not proc.alive() and proc in self.workers[:workers]:
                    raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
            ready = self.ready_workers(model)
            return ready if len(ready) >= workers else None

        return wait_until(check, timeout, interval=0.1, what=f"{workers} ready workers of {model}")

    def instance_pid(self, instance_hex: str) -> int:
        for inst in self.health()["instances"]:
            if inst["instance_id"] == instance_hex and inst["endpoint"] == "generate":
                return int(inst["pid"])
        raise KeyError(instance_hex)

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        for proc in self.workers:
            proc.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def worker_control(cluster: LocalCluster, endpoint: str, worker_hex: str, body: dict) -> list:
    """Calls a worker's control endpoint (``drain``, ``wake_up``...) as ``dynamoctl`` does."""
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(cluster.file_kv), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        client = await rt.namespace().component("backend").endpoint(endpoint).client()
        await client.wait_for_instances(1, 10, routable=False)
        return await client.call(body, instance_id=int(worker_hex, 16))
    finally:
        await rt.shutdown(grace_s=0.5)


@contextlib.contextmanager
def running_cluster(root: Path, workers: int = 2, **kwargs: float) -> Iterator[LocalCluster]:
    """``workers`` mocker workers and a frontend, ready; all stopped on exit."""
    with LocalCluster(root, **kwargs) as cluster:
        for _ in range(workers):
            cluster.start_worker()
        cluster.start_frontend()
        cluster.wait_ready(workers)
        yield cluster


def cluster_fixture(name: str, workers: int = 2, **kwargs: float) -> Callable[..., Iterator[LocalCluster]]:
    """A module-scoped ``cluster`` fixture: one ``running_cluster`` in a temp folder ``name``, shared by
    the module's tests (each leaves it as it found it). Assign it as ``cluster = cluster_fixture(...)``."""

    @pytest.fixture(scope="module", name="cluster")
    def _cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
        with running_cluster(tmp_path_factory.mktemp(name), workers, **kwargs) as c:
            yield c

    return _cluster


def openai_fixture(timeout: float) -> Callable[..., openai.OpenAI]:
    """An ``api`` fixture: the official OpenAI client on the ``cluster`` fixture's frontend, no retries
    (a retry would hide a failed request). Assign it as ``api = openai_fixture(...)``."""

    @pytest.fixture(name="api")
    def _api(cluster: LocalCluster) -> openai.OpenAI:
        return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=timeout)

    return _api
