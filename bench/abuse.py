"""Adversarial bench: for each attack, is an authenticated operator and a normal client still served,
and how fast, while the attack runs? Prints JSON.

Starts, on loopback, one mocker worker (cluster token on its request plane, ``--lora-root``) and a
frontend with API keys, both with the hardened defaults (nothing tuned for the bench except the
deadlines given as flags below), then runs each attack for ``--seconds``:

- ``preauth_flood``: connections to the worker's request plane that never present the token, kept
  at ``--flood-connections`` (re-opened as the worker closes them);
- ``fanout``: /v1/completions bodies with 50,000 prompts, back to back;
- ``slow_clients``: idle, header-trickling and body-trickling HTTP connections (``--slow`` of each),
  re-opened as they are cut;
- ``key_guessing``: wrong API keys on /metrics and /health, as fast as answered;
- ``lora_sources``: ``load_lora`` of /etc, a ``..`` path, a symlink out of the root, s3:// and
  hf:// sources, and an escape-sequence name.

During each, every 0.2 s: the *operator* drains and wakes the worker over a fresh request-plane
connection with the token (as a ``dynamoctl`` run does), and a *normal client* sends a 3-token chat
with a valid key from another loopback address. Reported per attack: both success rates and their
latencies (p50/max, ms), and what the attack achieved. ``baseline`` is the same with no attack.

    python bench/abuse.py --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import free_port, percentile, stop_processes  # noqa: E402

from dynamod.console.actions.control import ControlClient  # noqa: E402
from dynamod.shared.config import RuntimeSettings  # noqa: E402
from dynamod.shared.runtime.distributed import DistributedRuntime  # noqa: E402
from dynamod.shared.security.settings import RequestPlaneSecurity, SecuritySettings  # noqa: E402
from dynamod.shared.security.token import ClusterToken  # noqa: E402

TOKEN = "bench-abuse-cluster-token-0123456789"
KEY = "bench-abuse-api-key-0123456789abcdef"
CLI = [sys.executable, "-m", "dynamod.daemon.cli"]


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.kv = root / "kv"
        self.adapters = root / "adapters"
        self.adapters.mkdir(parents=True)
        (root / "token").write_text(TOKEN)
        (root / "keys").write_text(KEY + "\n")
        self.http_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
        env.update(DYN_FILE_KV=str(self.kv), DYN_CLUSTER_TOKEN_FILE=str(root / "token"), DYN_LORA_ROOT=str(self.adapters))
        self.env = env
        common = ["--discovery-backend", "file", "--event-plane", "zmq", "--file-kv", str(self.kv), "--lease-ttl", "3"]
        self.procs = [
            subprocess.Popen([*CLI, "--role", "agg", "--engine", "mocker", "--model", "tiny", "--speedup-ratio", "20",
                              "--request-plane-max-connections", "64", "--request-plane-handshake-timeout", "2", *common],
                             env=env, stdout=open(root / "worker.log", "wb"), stderr=subprocess.STDOUT),  # noqa: SIM115
            subprocess.Popen([*CLI, "--role", "frontend", "--http-port", str(self.http_port), "--api-key-file",
                              str(root / "keys"), "--http-idle-timeout", "2", "--http-header-timeout", "2",
                              "--http-body-timeout", "2", *common],
                             env=env, stdout=open(root / "frontend.log", "wb"), stderr=subprocess.STDOUT),  # noqa: SIM115
        ]
        settings = RuntimeSettings(discovery_backend="file", file_kv=str(self.kv), event_plane="zmq", lease_ttl_s=3.0)
        settings.security = SecuritySettings(request_plane=RequestPlaneSecurity(token=ClusterToken(TOKEN)))
        self.settings = settings
        self.worker_id = 0
        self.worker_address = ("127.0.0.1", 0)

    def stop(self) -> None:
        stop_processes(self.procs, 15)


def http_call(port: int, method: str, path: str, body: Any = None, key: str | None = KEY, source: str = "127.0.0.1",
         timeout: float = 10.0) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    try:
        conn.request(method, path, json.dumps(body).encode() if body is not None else None, headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - t0
    except OSError:
        return 0, time.perf_counter() - t0
    finally:
        conn.close()


def normal_chat(port: int) -> tuple[bool, float]:
    status, elapsed = http_call(port, "POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, source="127.0.0.2")
    return status == 200, elapsed


async def operator_action(cluster: Cluster) -> tuple[bool, float]:
    """drain + wake on a fresh runtime (a new connection), as two dynamoctl runs would."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(15):
            rt = await DistributedRuntime.create(cluster.settings, events=False)
            ctl = ControlClient(rt, namespace="dynamo")
            try:
                ok = (await ctl.drain(cluster.worker_id)).ok and (await ctl.wake(cluster.worker_id)).ok
            finally:
                await ctl.close()
                await rt.shutdown(0)
    except Exception:  # noqa: BLE001 - a failed action is the measurement
        ok = False
    return ok, time.perf_counter() - t0


def _summary(results: list[tuple[bool, float]]) -> dict[str, float]:
    lat = [t * 1000 for ok, t in results if ok]
    return {
        "served": sum(ok for ok, _ in results), "tried": len(results),
        "p50_ms": round(percentile(lat, 0.5), 1), "max_ms": round(max(lat), 1) if lat else 0.0,
    }


# -- attacks: each runs in a thread until ``stop`` is set and returns what it achieved -------------------


def _reap_closed(socks: list[socket.socket]) -> tuple[list[socket.socket], int]:
    """The sockets the server has not closed yet, and how many it closed (what it wrote first,
    such as a 408, is read past); the closed ones are closed here too."""
    alive = []
    for s in socks:
        s.setblocking(False)
        try:
            while s.recv(65536):
                pass
            gone = True
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            s.close()
        else:
            alive.append(s)
    return alive, len(socks) - len(alive)


def _hold_connections(stop: threading.Event, count: int, connect: Callable[[int], socket.socket],
                      every_s: float) -> tuple[int, int]:
    """Keeps ``count`` connections open until ``stop``: every ``every_s`` the ones the server closed
    are reaped and replaced (``connect(n)`` opens the n-th). Returns (opened, closed by the server)."""
    socks: list[socket.socket] = []
    opened = cut = 0
    while not stop.is_set():
        socks, dropped = _reap_closed(socks)
        cut += dropped
        while len(socks) < count and not stop.is_set():
            try:
                socks.append(connect(opened))
                opened += 1
            except OSError:
                break
        stop.wait(every_s)
    for s in socks:
        s.close()
    return opened, cut


def attack_preauth_flood(cluster: Cluster, stop: threading.Event, args: argparse.Namespace) -> dict[str, Any]:
    opened, cut = _hold_connections(
        stop, args.flood_connections, lambda _: socket.create_connection(cluster.worker_address, timeout=2), 0.05
    )
    return {"opened": opened, "closed_by_worker": cut}


def attack_fanout(cluster: Cluster, stop: threading.Event, args: argparse.Namespace) -> dict[str, Any]:
    statuses: dict[int, int] = {}
    body = {"model": "tiny", "prompt": ["a"] * 50_000, "max_tokens": 3}
    while not stop.is_set():
        status, _ = http_call(cluster.http_port, "POST", "/v1/completions", body)
        statuses[status] = statuses.get(status, 0) + 1
    return {"responses": statuses}


def attack_slow_clients(cluster: Cluster, stop: threading.Event, args: argparse.Namespace) -> dict[str, Any]:
    partial = {
        "idle": b"",
        "headers": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        "body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{",
    }

    def connect(n: int) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=2, source_address=("127.0.0.3", 0))
        kind = ("idle", "headers", "body")[n % 3]
        try:
            if partial[kind]:
                s.sendall(partial[kind])
        except OSError:
            s.close()
            raise
        return s

    opened, cut = _hold_connections(stop, 3 * args.slow, connect, 0.1)
    return {"opened": opened, "cut_by_frontend": cut}


def attack_key_guessing(cluster: Cluster, stop: threading.Event, args: argparse.Namespace) -> dict[str, Any]:
    statuses: dict[int, int] = {}
    i = 0
    while not stop.is_set():
        path = ("/metrics", "/health")[i % 2]
        status, _ = http_call(cluster.http_port, "GET", path, key=f"guess-{i:08d}-abcdefghijkl", source="127.0.0.4")
        statuses[status] = statuses.get(status, 0) + 1
        i += 1
    return {"guesses": i, "responses": statuses}


def attack_lora_sources(cluster: Cluster, stop: threading.Event, args: argparse.Namespace) -> dict[str, Any]:
    outside = cluster.root / "outside" / "evil"
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "adapter_config.json").write_text("{}")
    link = cluster.adapters / "link"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    attempts = [("e1", "/etc"), ("e2", str(cluster.adapters / ".." / "outside" / "evil")), ("e3", str(link)),
                ("e4", "s3://bucket/evil"), ("e5", "hf://org/evil"), ("e6", "/proc/self/environ"),
                ("\x1b]0;pwned\x07", "/etc")]

    async def run() -> dict[str, Any]:
        rt = await DistributedRuntime.create(cluster.settings, events=False)
        ctl = ControlClient(rt, namespace="dynamo")
        loaded = refused = 0
        try:
            while not stop.is_set():
                for name, source in attempts:
                    try:
                        result = await ctl.load_lora(cluster.worker_id, name, source)
                        loaded += result.ok
                        refused += not result.ok
                    except Exception:  # noqa: BLE001 - a refusal raised is a refusal
                        refused += 1
                await asyncio.sleep(0.05)
        finally:
            await ctl.close()
            await rt.shutdown(0)
        return {"loaded": loaded, "refused": refused}

    return asyncio.run(run())


ATTACKS = {
    "baseline": None,
    "preauth_flood": attack_preauth_flood,
    "fanout": attack_fanout,
    "slow_clients": attack_slow_clients,
    "key_guessing": attack_key_guessing,
    "lora_sources": attack_lora_sources,
}


async def measure(cluster: Cluster, name: str, args: argparse.Namespace) -> dict[str, Any]:
    stop = threading.Event()
    outcome: dict[str, Any] = {}
    attack = ATTACKS[name]
    thread = None
    if attack is not None:
        thread = threading.Thread(target=lambda: outcome.update(attack(cluster, stop, args)), daemon=True)
        thread.start()
        await asyncio.sleep(0.5)  # let the attack build up before measuring
    operator: list[tuple[bool, float]] = []
    normal: list[tuple[bool, float]] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        normal.append(await asyncio.to_thread(normal_chat, cluster.http_port))
        operator.append(await operator_action(cluster))
        await asyncio.sleep(0.2)
    stop.set()
    if thread is not None:
        await asyncio.to_thread(thread.join, 30)
    return {"operator": _summary(operator), "normal_client": _summary(normal), "attack": outcome}


async def wait_ready(cluster: Cluster) -> None:
    rt = await DistributedRuntime.create(cluster.settings, events=False)
    try:
        client = await rt.namespace().component("backend").endpoint("generate").client()
        await client.wait_for_instances(1, timeout=60)
        inst = client.instances[0]
        cluster.worker_id = inst.instance_id
        host, port = inst.address.rsplit(":", 1)
        cluster.worker_address = (host, int(port))
        await client.close()
    finally:
        await rt.shutdown(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (await asyncio.to_thread(normal_chat, cluster.http_port))[0]:
            return
        await asyncio.sleep(0.2)
    raise SystemExit("abuse bench: the frontend did not become ready")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="dynamod-abuse-"))
    cluster = Cluster(root)
    try:
        await wait_ready(cluster)
        results = {}
        for name in args.attacks:
            results[name] = await measure(cluster, name, args)
        return {"seconds_per_attack": args.seconds, "results": results}
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="measuring time per attack [default 5]")
    p.add_argument("--flood-connections", type=int, default=200, help="pre-auth connections held [default 200]")
    p.add_argument("--slow", type=int, default=100, help="slow HTTP connections of each kind [default 100]")
    p.add_argument("--attacks", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    args = p.parse_args()
    print(json.dumps(asyncio.run(main_async(args)), indent=2))


if __name__ == "__main__":
    main()
