"""``dynamod up``: one command gives a working local cluster, heals a crashed worker, and stops
cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.fixtures.servers import free_port, wait_until
from tests.integration.test_frontend_support import clean_env, get_json, pid_gone

pytestmark = pytest.mark.timeout(180)


def _ready(url: str) -> list[dict]:
    try:
        body = get_json(url + "/health")
    except (OSError, ValueError):
        return []
    models = [m for m in body.get("models", []) if m["model"] == "tiny"]
    return [w for w in models[0]["workers"] if w["status"] == "ready"] if models else []


def test_up_serves_heals_and_stops(tmp_path: Path) -> None:
    port = free_port()
    file_kv = tmp_path / "discovery"
    cmd = [
        sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(port), "--workers", "2",
        "--speedup-ratio", "10", "--file-kv", str(file_kv), "--log-dir", str(tmp_path / "logs"),
        "--worker-args", "--lease-ttl 2",
    ]
    proc = subprocess.Popen(cmd, env=clean_env(file_kv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: any("dynamod is up" in line for line in lines), 90, what="the banner")
        out = "".join(lines)
        assert f"{url}/v1" in out
        # The printed curl line works as printed.
        curl = next(line for line in lines if "curl -s" in line)
        argv = shlex.split(curl.split("try:", 1)[1])
        body = json.loads(argv[argv.index("-d") + 1])
        reply = httpx.post(argv[2], json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"

        health = get_json(url + "/health")
        frontend_pid = health["pid"]
        workers = {i["instance_id"]: i["pid"] for i in health["instances"] if i["endpoint"] == "generate"}
        assert len(workers) == 2
        victim_id, victim_pid = next(iter(workers.items()))
        os.kill(victim_pid, signal.SIGKILL)

        def healed() -> list[int] | None:
            ready = {w["instance_id"] for w in _ready(url)}
            listed = {i["instance_id"]: i["pid"] for i in get_json(url + "/health")["instances"] if i["endpoint"] == "generate"}
            if len(ready) == 2 and victim_id not in ready and set(listed) == ready:
                return list(listed.values())
            return None

        worker_pids = wait_until(healed, 60, what="the supervisor to replace the killed worker")
        assert victim_pid not in worker_pids
        pids = [frontend_pid, *worker_pids]
        reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert reply.status_code == 200

        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(60) == 0
        for pid in pids:
            wait_until(lambda pid=pid: pid_gone(pid), 10, what=f"child {pid} to exit")
        assert not any(re.search(r"Traceback", line) for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
