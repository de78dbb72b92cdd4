"""Guessing the cluster token on a worker's status server is rate-limited (issue 25, item 5)."""

from __future__ import annotations

import http.client
import time
from pathlib import Path

import pytest

from tests.fixtures.daemons import DaemonProcess, file_cluster_env
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.timeout(60)

TOKEN = "status-server-token-0123456789abc"


def _get(port: int, token: str | None, source: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_wrong_tokens_on_metrics_get_429_per_address(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    port = free_port()
    worker = DaemonProcess(
        ["--role", "agg", "--engine", "mocker", "--model", "tiny", "--system-port", str(port)],
        env=file_cluster_env(tmp_path / "kv", DYN_CLUSTER_TOKEN_FILE=str(tmp_path / "token")), log_dir=str(tmp_path),
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if _get(port, TOKEN, "127.0.0.1") == 200:
                    break
            except OSError:
                pass
            assert worker.alive() and time.monotonic() < deadline, worker.log()[-2000:]
            time.sleep(0.1)
        statuses = [_get(port, f"guess-{i:04d}-0123456789abcdef", "127.0.0.7") for i in range(25)]
        assert statuses[:10] == [401] * 10 and set(statuses[11:]) == {429}, statuses
        assert _get(port, TOKEN, "127.0.0.7") == 429  # not even checked from there now
        assert _get(port, TOKEN, "127.0.0.1") == 200  # a member elsewhere is served
    finally:
        worker.kill()
