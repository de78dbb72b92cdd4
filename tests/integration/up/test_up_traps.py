"""``dynamod up`` does what a person expects (issue 24, items 1-8): real `up` processes.

One cluster serves the module: API keys on (``DYN_API_KEY``), an HTTPS frontend, a worker flag
written as one ``--``-word, and a short ``--hang-timeout``. Before the fixes it never printed its
banner (the readiness poll read ``/health`` without a key, over plain HTTP), its frontend was
killed as hung by the plain-HTTP liveness probe, and the ``--``-word was an argparse error.
The other tests start an `up` that must stop at once with one line, before any child serves.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.fixtures.daemons import Up, up_command
from tests.fixtures.servers import free_port, wait_until
from tests.fixtures.tls import make_cluster_certs
from tests.integration.frontend.test_frontend_support import clean_env

pytestmark = pytest.mark.timeout(150)

API_KEY = "sk-test-" + "k" * 24
HANG_TIMEOUT_S = 3.0


@dataclass
class SecuredUp:
    up: Up
    port: int
    ca: str
    file_kv: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=f"https://127.0.0.1:{self.port}", verify=ssl.create_default_context(cafile=self.ca),
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)

    def child_pid(self, name: str) -> int:
        pids = re.findall(rf"child started name={re.escape(name)} pid=(\d+)", self.up.output)
        return int(pids[-1])


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredUp]:
    root = tmp_path_factory.mktemp("up-traps")
    certs = make_cluster_certs(root / "certs")
    port = free_port()
    file_kv = root / "discovery"
    env = {**clean_env(file_kv), "DYN_API_KEY": API_KEY}
    up = Up(
        up_command(
            "--http-port", str(port), "--workers", "2", "--speedup-ratio", "10", "--file-kv", str(file_kv),
            "--log-dir", str(root / "logs"), "--hang-timeout", str(HANG_TIMEOUT_S), "--ready-timeout", "60",
            "--crash-limit", "2",
            "--frontend-args", f"--http-tls-cert-file {certs.node_cert} --http-tls-key-file {certs.node_key}",
            "--worker-args", "--max-num-seqs=8",  # one word starting with --: a value, not a flag of `up`
        ),
        env, cwd=root,
    )
    try:
        up.wait_up()
        yield SecuredUp(up, port, certs.ca, file_kv)
        up.proc.send_signal(2)
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.kill()


def test_keys_and_https_frontend_come_up_and_stay_up(secured: SecuredUp) -> None:
    """Items 1, 2, 7: the banner names the https URL; the frontend serves with the key and is not
    killed by its liveness probe over several hang timeouts; the --max-num-seqs=8 word reached the workers."""
    assert f"OpenAI API: https://127.0.0.1:{secured.port}/v1" in secured.up.output
    frontend = secured.child_pid("frontend")
    with secured.client() as client:
        # Several probe rounds (every 2 s) past the hang timeout, serving all along.
        until = time.monotonic() + 3 * HANG_TIMEOUT_S
        while time.monotonic() < until:
            reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
            assert reply.status_code == 200, reply.text
    assert "frontend died" not in secured.up.output, secured.up.output
    assert secured.child_pid("frontend") == frontend
    for worker in ("worker-0", "worker-1"):
        argv = Path(f"/proc/{secured.child_pid(worker)}/cmdline").read_bytes().split(b"\0")
        assert b"--max-num-seqs=8" in argv


def test_a_second_up_on_the_same_directory_is_refused(secured: SecuredUp) -> None:
    """Item 4: a second `up` with its own port but the first one's discovery directory stops at
    once, naming the running one and --file-kv, and starts nothing."""
    other = free_port()
    second = subprocess.run(
        up_command("--http-port", str(other), "--workers", "1", "--file-kv", str(secured.file_kv)),
        env=clean_env(secured.file_kv), capture_output=True, text=True, timeout=60,
    )
    assert second.returncode == 1, second.stdout + second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith("dynamod up: error: another `dynamod up` (pid ")
    assert f"pid {secured.up.proc.pid}" in line and f"127.0.0.1:{secured.port}" in line and "--file-kv DIR" in line
    assert "child started" not in second.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{other}/live", timeout=2)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--worker-args", "--system-port 0"), "--worker-args: --system-port is set by `dynamod up`"),
        (("--frontend-args=--http-port=9000",), "--frontend-args: --http-port is set by `dynamod up`"),
    ],
)
def test_flags_up_sets_are_refused_in_pass_through_args(tmp_path: Path, flags: tuple[str, ...], expected: str) -> None:
    """Item 3: a pass-through flag that would override what `up` set (and then probes) is one line
    and a non-zero exit, before any child starts."""
    file_kv = tmp_path / "discovery"
    done = subprocess.run(up_command("--http-port", str(free_port()), "--file-kv", str(file_kv), *flags),
                          env=clean_env(file_kv), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dynamod up: error: {expected}"), done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--api-key", API_KEY],
        ["--role", "frontend", "--api-key", API_KEY],
        ["--role", "frontend", f"--api-key={API_KEY}"],
    ],
)
def test_abbreviations_are_off_and_a_secret_is_never_echoed(tmp_path: Path, argv: list[str]) -> None:
    """Item 8: ``--api-key`` is no abbreviation of ``--api-key-file``; the refusal names the flag
    and does not print the value."""
    done = subprocess.run([sys.executable, "-P", "-m", "dynamod.daemon.cli", *argv], env=clean_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert API_KEY not in done.stdout + done.stderr
    assert done.stderr.strip().endswith("error: unrecognized arguments: --api-key (and 1 value, not shown)")


def _ctl(secured: SecuredUp, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", *argv, "--file-kv", str(secured.file_kv)],
                          env=clean_env(secured.file_kv), capture_output=True, text=True, timeout=60)


def test_a_crash_looping_worker_is_given_up_on_alone_and_restarted_on_request(secured: SecuredUp) -> None:
    """Item 6: worker-1 dies --crash-limit (2) times; `up` stops restarting it but keeps serving
    with worker-0, `dynamoctl status` lists it as failed, `dynamoctl restart worker-1` brings it back."""
    first = secured.child_pid("worker-1")
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: secured.child_pid("worker-1") != first, 30, what="worker-1 restarted once")
    os.kill(secured.child_pid("worker-1"), signal.SIGKILL)
    wait_until(lambda: "`dynamoctl restart worker-1` tries it again" in secured.up.output, 30, what="give up on worker-1")
    assert "not restarting it (crash loop); the other agg workers serve on" in secured.up.output
    assert secured.up.proc.poll() is None, secured.up.output
    with secured.client() as client:
        for _ in range(4):
            reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
            assert reply.status_code == 200, reply.text

    status = _ctl(secured, "status")
    assert status.returncode == 0, status.stderr
    failed = [line for line in status.stdout.splitlines() if line.startswith("worker-1 ")]
    assert len(failed) == 1 and "agg" in failed[0] and "killed by SIGKILL" in failed[0], status.stdout
    assert "dynamoctl restart NAME" in status.stdout

    refused = _ctl(secured, "restart", "worker-0")
    assert refused.returncode == 1 and "worker-0 is not a failed worker" in refused.stderr, refused.stderr
    done = _ctl(secured, "restart", "worker-1")
    assert done.returncode == 0, done.stderr
    wait_until(lambda: "dynamod up: restarting worker-1" in secured.up.output, 10, what="the restart")
    pid = secured.child_pid("worker-1")

    def both_ready() -> bool:
        with secured.client() as client:
            body = client.get("/health").json()
        return sum(m.get("ready", 0) for m in body.get("models", []) if not m.get("lora")) == 2

    wait_until(both_ready, 60, interval=0.2, what="worker-1 serving again")
    assert secured.child_pid("worker-1") == pid
    assert "FAILED WORKER" not in _ctl(secured, "status").stdout
