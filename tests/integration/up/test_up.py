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
from pathlib import Path

import httpx
import pytest

from tests.fixtures.daemons import Up
from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import clean_env, get_json, pid_gone

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
    up = Up(cmd, clean_env(file_kv))
    proc, lines = up.proc, up.lines
    url = f"http://127.0.0.1:{port}"
    try:
        out = up.wait_up()
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
        up.kill()


def test_up_starts_prefill_and_decode_pools(tmp_path: Path) -> None:
    """``--prefill-workers 1 --decode-workers 1``: one process per role, each on its own status
    port, the banner names both pools once the frontend sees them, and a chat completion is served.
    Discovery shows the roles the console and dynamoctl read."""
    port = free_port()
    file_kv = tmp_path / "discovery"
    cmd = [
        sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(port),
        "--prefill-workers", "1", "--decode-workers", "1", "--speedup-ratio", "10",
        "--file-kv", str(file_kv), "--log-dir", str(tmp_path / "logs"),
    ]
    up = Up(cmd, clean_env(file_kv))
    proc, lines = up.proc, up.lines
    url = f"http://127.0.0.1:{port}"
    try:
        out = up.wait_up()
        assert "1 prefill + 1 decode worker(s) serving 'tiny'" in out
        assert re.search(r"prefill: +1 worker\(s\), component 'prefill'", out), out
        assert re.search(r"decode: +1 worker\(s\), component 'backend'", out), out

        health = get_json(url + "/health")
        tiny = next(m for m in health["models"] if m["model"] == "tiny")
        assert tiny["ready"] == 1 and tiny["prefill_ready"] == 1

        # Each role is its own process, registered under its role and component.
        res = subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(file_kv), "status", "--json"],
                             capture_output=True, text=True, timeout=60, env=clean_env(file_kv))
        assert res.returncode == 0, res.stderr
        workers = [r for r in json.loads(res.stdout) if r["role"] in ("prefill", "decode")]
        assert sorted((r["role"], r["component"]) for r in workers) == [("decode", "backend"), ("prefill", "prefill")]
        assert len({r["pid"] for r in workers}) == 2
        assert all(r["status"] == "ready" for r in workers)
        # The frontend's pools are these very processes.
        by_role = {r["role"]: r["id"] for r in workers}
        assert tiny["prefill_workers"] == [by_role["prefill"]]
        assert [w["instance_id"] for w in tiny["workers"]] == [by_role["decode"]]

        reply = httpx.post(url + "/v1/chat/completions", timeout=30,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"

        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for r in workers:
            wait_until(lambda pid=r["pid"]: pid_gone(pid), 10, what=f"{r['role']} worker {r['pid']} to exit")
        assert not any("Traceback" in line for line in lines)
    finally:
        up.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "2", "--decode-workers", "1"], "cannot be combined"),
        (["--prefill-workers", "2"], "needs --decode-workers"),
        (["--prefill-workers", "1", "--decode-workers", "-1"], "--decode-workers must be 0 or more"),
    ],
)
def test_up_refuses_pool_flags_that_make_no_sense(tmp_path: Path, flags: list[str], message: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(free_port()), "--file-kv", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=60, env=clean_env(tmp_path),
    )
    assert res.returncode != 0
    assert message in res.stderr, res.stderr
