"""``dynamod up``'s supervisor: children start from any directory, a crashed child's log is shown,
and a child that cannot start ends `up` with one message instead of restarting for ever."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.daemons import Up, up_command
from tests.fixtures.servers import free_port
from tests.integration.frontend.test_frontend_support import clean_env, pid_gone

pytestmark = pytest.mark.timeout(180)

def test_up_from_a_directory_holding_a_dynamod_folder(tmp_path: Path) -> None:
    """The parent of a clone holds `dynamod/`: the children must import the installed package, not it."""
    shadow = tmp_path / "dynamod"
    shadow.mkdir()
    (shadow / "__init__.py").write_text('raise ImportError("the shadowing dynamod folder was imported")\n')
    port = free_port()
    file_kv = tmp_path / "state" / "discovery"
    up = Up(
        up_command("--http-port", str(port), "--workers", "1", "--speedup-ratio", "10",
                    "--file-kv", str(file_kv), "--log-dir", str(tmp_path / "state" / "logs")),
        clean_env(file_kv), cwd=tmp_path,
    )
    try:
        up.wait_up()
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert "died" not in up.output and "shadowing" not in up.output
        up.proc.send_signal(2)
        assert up.proc.wait(60) == 0
    finally:
        up.kill()


def test_a_child_that_cannot_start_ends_up_with_one_message(tmp_path: Path) -> None:
    """A worker flag with a bad value: the worker exits with a usage error (status 2), which no
    restart fixes. `up` shows why (the log's last lines), does not restart it, stops the frontend,
    and exits non-zero with one line naming the worker, its error and its log (issue 24 item 5:
    it used to restart it --crash-limit times first)."""
    port = free_port()
    file_kv = tmp_path / "discovery"
    logs = tmp_path / "logs"
    up = Up(
        up_command("--http-port", str(port), "--workers", "1", "--file-kv", str(file_kv), "--log-dir", str(logs),
                    "--worker-args", "--max-num-seqs lots", "--crash-limit", "3", "--crash-window", "60"),
        clean_env(file_kv), cwd=tmp_path,
    )
    started = time.monotonic()
    try:
        code = up.proc.wait(90)
        elapsed = time.monotonic() - started
        up.reader.join(10)
    finally:
        up.kill()
    assert code == 1, up.output
    assert elapsed < 30, f"gave up only after {elapsed:.0f}s"
    last = up.output.rstrip().splitlines()[-1]
    assert last.startswith(
        "dynamod up: error: worker-0 refused its flags (exit code 2): "
        "dynamod --role agg: error: argument --max-num-seqs: invalid int value: 'lots'"
    ), last
    assert f"See its log: {logs / 'worker-0.log'}" in last
    # The death was reported once, with the reason the worker gave, straight from its log.
    assert up.output.count("dynamod up: worker-0 died (exit code 2)") == 1
    assert "not restarting it (a usage error)" in up.output and "restarting it in" not in up.output
    assert "dynamod is up" not in up.output and "Traceback" not in up.output
    frontend_pid = int(re.search(r"child started name=frontend pid=(\d+)", up.output).group(1))  # type: ignore[union-attr]
    assert pid_gone(frontend_pid), "the frontend outlived `dynamod up`"
