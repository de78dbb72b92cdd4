"""A frontend with API keys and tight connection deadlines in front of one mocker worker, and the
raw-socket clients the abuse tests (and ``bench/abuse.py``) attack it with."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from pathlib import Path

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster

KEYS = {"fanout": "key-fanout-0123456789abcdef", "normal": "key-normal-0123456789abcdef",
        "rate": "key-rate-0123456789abcdef012", "slow": "key-slow-0123456789abcdef012"}


def start_guarded_cluster(root: Path, *extra: str) -> LocalCluster:
    keys = root / "keys"
    root.mkdir(parents=True, exist_ok=True)
    keys.write_text("\n".join(KEYS.values()) + "\n")
    cluster = LocalCluster(root, speedup=20.0)
    cluster.start_worker()
    cluster.start_frontend("--api-key-file", str(keys), *extra)
    wait_until(lambda: ready(cluster), 60, interval=0.1, what="frontend with one ready worker")
    return cluster


def request(cluster: LocalCluster, method: str, path: str, body: object | None = None, *, key: str | None = KEYS["normal"],
            source: str = "127.0.0.1", timeout: float = 30.0) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of one request on a connection of its own from ``source``."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=timeout, source_address=(source, 0))
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    started = time.perf_counter()
    try:
        conn.request(method, path, json.dumps(body).encode() if body is not None else None, headers)
        resp = conn.getresponse()
        raw = resp.read()
        elapsed = time.perf_counter() - started
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"raw": raw.decode(errors="replace")}
        return resp.status, data, elapsed
    finally:
        conn.close()


def ready(cluster: LocalCluster) -> bool:
    try:
        status, body, _ = request(cluster, "GET", "/health", timeout=2)
    except OSError:
        return False
    return status == 200 and any(m["workers"] for m in body.get("models", []))


def chat(cluster: LocalCluster, key: str = KEYS["normal"], max_tokens: int = 3) -> tuple[int, float]:
    status, _, elapsed = request(cluster, "POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}, key=key)
    return status, elapsed


def slow_sockets(port: int, kind: str, count: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """``count`` connections that stall: ``idle`` send nothing, ``headers`` half a request line and
    headers, ``body`` whole headers announcing a body they never finish."""
    partial = {
        "idle": b"",
        "headers": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        "body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["slow"].encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"model\": ",
    }[kind]
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        if partial:
            s.sendall(partial)
        socks.append(s)
    return socks


def closed_by_server(sock: socket.socket) -> bool:
    """True once the peer closed (a 408 it wrote first is read past)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
