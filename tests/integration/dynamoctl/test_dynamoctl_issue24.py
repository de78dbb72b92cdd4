"""dynamoctl against file discovery, no workers needed: the failed workers of a ``dynamod up``
supervisor in ``status`` and ``status --json`` (issue 24 item 6), and names that carry escape
sequences printed as visible text (issue 25 item 7)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.protocol.intent import WorkerIntent, encode_intent
from dynamod.shared.protocol.keys import intent_key
from dynamod.shared.protocol.supervisor import FailedWorker, failed_key, restart_key

ESCAPE = "\x1b]0;owned\x07\x1b[2J"


def ctl(file_kv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(file_kv), *args],
                          capture_output=True, text=True, timeout=60)


async def _put(root: Path, items: dict[str, bytes]) -> None:
    store = FileStore(str(root))
    await store.start()
    try:
        for key, value in items.items():
            await store.put(key, value)
    finally:
        await store.close()


async def test_status_lists_failed_workers_in_the_table_and_the_json(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    record = FailedWorker(name="worker-1", pool="decode", reason="exit code 3", crashes=5, window_s=60.0,
                          log="/var/log/dynamod/worker-1.log", supervisor_pid=4242, ts=time.time() - 5)
    await _put(root, {failed_key("dynamo", "worker-1"): msgspec.json.encode(record),
                      restart_key("dynamo", "worker-9"): b'{"name": "worker-9"}'})  # a request, not a failure

    table = ctl(root, "status", "--wait", "0")
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("worker-1 ")]
    assert len(rows) == 1 and "decode" in rows[0] and "exit code 3" in rows[0], table.stdout
    assert "FAILED WORKER" in table.stdout and "dynamoctl restart NAME" in table.stdout
    assert "worker-9" not in table.stdout

    listed = ctl(root, "status", "--json", "--wait", "0")
    assert listed.returncode == 0, listed.stderr
    records = json.loads(listed.stdout)
    assert [r["name"] for r in records if r["status"] == "failed"] == ["worker-1"]
    failed = records[0]
    assert failed["role"] == "decode" and failed["id"] is None
    assert failed["failed"]["reason"] == "exit code 3" and failed["failed"]["log"] == "/var/log/dynamod/worker-1.log"
    assert failed["failed"]["restart"] == "dynamoctl restart worker-1"


async def test_names_from_discovery_print_escapes_as_text(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    evil = WorkerIntent(status="draining", loras={f"sql{ESCAPE}": "/a"}, set_by=f"drain{ESCAPE}")
    await _put(root, {intent_key("dynamo", "backend", "w0"): encode_intent(evil)})
    listed = ctl(root, "intent", "list")
    assert listed.returncode == 0, listed.stderr
    assert "\x1b" not in listed.stdout and "\x07" not in listed.stdout
    assert "sql\\x1b]0;owned\\x07\\x1b[2J" in listed.stdout and "drain\\x1b" in listed.stdout
