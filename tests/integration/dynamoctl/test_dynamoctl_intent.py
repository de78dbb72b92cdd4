"""``dynamoctl intent list|clear`` against file discovery: what an operator sees of kept intent,
and forgetting the intent of a worker name that is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.protocol.intent import WorkerIntent, encode_intent
from dynamod.shared.protocol.keys import intent_key


def ctl(file_kv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(file_kv), *args],
                          capture_output=True, text=True, timeout=60)


async def test_list_and_clear(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = FileStore(str(root))
    await store.start()
    try:
        await store.put(intent_key("dynamo", "backend", "w0"),
                        encode_intent(WorkerIntent(status="draining", ts=1.0, set_by="drain")))
        await store.put(intent_key("dynamo", "backend", "w1"),
                        encode_intent(WorkerIntent(status="sleeping", sleep_level=2, loras={"sql": "/a"}, set_by="sleep")))
        await store.put(intent_key("dynamo", "prefill", "w1"), encode_intent(WorkerIntent(loras={"x": "/b"})))
        await store.put(intent_key("other", "backend", "w9"), b"{not json")
    finally:
        await store.close()

    res = ctl(root, "intent", "list", "--json")
    assert res.returncode == 0, res.stderr
    rows = {(r["namespace"], r["component"], r["worker_name"]): r for r in json.loads(res.stdout)}
    assert rows[("dynamo", "backend", "w0")]["status"] == "draining"
    assert rows[("dynamo", "backend", "w1")]["sleep_level"] == 2 and rows[("dynamo", "backend", "w1")]["loras"] == {"sql": "/a"}
    assert "error" in rows[("other", "backend", "w9")]  # shown, not a traceback
    table = ctl(root, "intent", "list", "--namespace", "dynamo")
    assert table.returncode == 0 and "draining" in table.stdout and "sql" in table.stdout and "w9" not in table.stdout

    res = ctl(root, "intent", "clear", "w0")
    assert res.returncode == 0 and "cleared intent of dynamo/backend/w0" in res.stdout, res.stderr
    # The same name under two components: the operator must say which.
    res = ctl(root, "intent", "clear", "w1")
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "--component" in res.stderr, res.stderr
    assert ctl(root, "intent", "clear", "w1", "--component", "prefill").returncode == 0
    res = ctl(root, "intent", "clear", "nobody")
    assert res.returncode == 1 and "no intent kept for worker 'nobody'" in res.stderr

    left = {(r["component"], r["worker_name"]) for r in json.loads(ctl(root, "intent", "list", "--json").stdout)}
    assert left == {("backend", "w1"), ("backend", "w9")}
