"""dynamoctl against a real local cluster of mocker workers: every command, its output for scripts
(JSON), its effect on the cluster, and its one-line errors with non-zero exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from dynamod.console.state.recording import replay
from dynamod.shared.protocol.worker_id import worker_id_hex
from tests.console.live import MockerCluster
from tests.fixtures.lora import make_adapter
from tests.fixtures.servers import free_port, wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockerCluster]:
    with MockerCluster(tmp_path_factory.mktemp("dynamoctl"), workers=3).start() as c:
        yield c


def ctl(cluster: MockerCluster | None, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    conn = ["--file-kv", cluster.file_kv] if cluster is not None else []
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", *conn, *args],
                          capture_output=True, text=True, timeout=timeout)


def status(cluster: MockerCluster) -> dict[str, dict]:
    res = ctl(cluster, "status", "--json")
    assert res.returncode == 0, res.stderr
    return {r["id"]: r for r in json.loads(res.stdout)}


def one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("dynamoctl: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_status_lists_every_instance(cluster: MockerCluster) -> None:
    ids = cluster.instance_ids()
    records = status(cluster)
    assert set(records) == {worker_id_hex(i) for i in ids}
    for r in records.values():
        assert r["component"] == "backend" and r["role"] == "agg" and r["status"] == "ready"
        assert r["model"] == "tiny" and r["loras"] == [] and r["node"]
        assert r["pid"] == cluster.proc.pid
        assert r["endpoint"] == "generate" and "drain" in r["endpoints"]
        assert r["load"] is not None and r["load"]["kv_usage"] is not None
    table = ctl(cluster, "status")
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split()[:4] == ["ID", "COMPONENT", "ROLE", "STATUS"]
    assert all(worker_id_hex(i) in table.stdout for i in ids)


def test_drain_and_wake(cluster: MockerCluster) -> None:
    target = worker_id_hex(cluster.instance_ids()[0])
    res = ctl(cluster, "drain", target[:10])  # a unique prefix is enough
    assert res.returncode == 0 and res.stdout.strip() == f"drain {target}: draining", res
    assert status(cluster)[target]["status"] == "draining"
    res = ctl(cluster, "wake", target, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["ok"] is True
    assert status(cluster)[target]["status"] == "ready"


def test_sleep_refuses_drain_until_woken(cluster: MockerCluster) -> None:
    target = worker_id_hex(cluster.instance_ids()[1])
    res = ctl(cluster, "sleep", target, "--level", "2")
    assert res.returncode == 0 and "sleeping at level 2" in res.stdout
    assert status(cluster)[target]["status"] == "sleeping"
    one_line_error(ctl(cluster, "drain", target), f"drain {target}", "wake it before draining")
    assert ctl(cluster, "wake", target).returncode == 0
    assert status(cluster)[target]["status"] == "ready"


def test_lora_load_list_unload(cluster: MockerCluster) -> None:
    target = worker_id_hex(cluster.instance_ids()[2])
    sql = str(make_adapter(cluster.root / "adapters", "sql").resolve())
    one_line_error(ctl(cluster, "lora", "load", target, "evil", "/etc"), "not inside an adapter directory")
    res = ctl(cluster, "lora", "load", target, "sql", f"file://{sql}")
    assert res.returncode == 0 and "loaded sql" in res.stdout, res
    listed = json.loads(ctl(cluster, "lora", "list", "--json").stdout)
    assert listed["errors"] == []
    assert [(x["instance"], x["name"], x["source"]) for x in listed["loras"]] == [(target, "sql", sql)]
    assert "sql" in ctl(cluster, "lora", "list", target).stdout
    assert status(cluster)[target]["loras"] == ["sql"]
    assert ctl(cluster, "lora", "unload", target, "sql").returncode == 0
    one_line_error(ctl(cluster, "lora", "unload", target, "sql"), "not loaded")
    assert json.loads(ctl(cluster, "lora", "list", "--json").stdout)["loras"] == []


def test_clear_kv(cluster: MockerCluster) -> None:
    target = worker_id_hex(cluster.instance_ids()[0])
    res = ctl(cluster, "clear-kv", target, "--json")
    assert res.returncode == 0
    body = json.loads(res.stdout)
    assert body["ok"] is True and body["action"] == "clear-kv" and "cleared_blocks" in body


def test_errors_are_one_line_and_non_zero(cluster: MockerCluster) -> None:
    one_line_error(ctl(cluster, "wake", "fffffffffffffff0"), "no instance fffffffffffffff0")
    one_line_error(ctl(cluster, "sleep", "not-hex"), "not an instance id")
    dead = f"http://127.0.0.1:{free_port()}"
    one_line_error(ctl(None, "--discovery", "etcd", "--etcd", dead, "--timeout", "3", "wake", "abc", timeout=60), "etcd")
    usage = ctl(cluster, "sleep", "abc", "--level", "7")
    assert usage.returncode == 2 and "invalid choice" in usage.stderr


def test_watch_prints_events_as_json_and_raw(cluster: MockerCluster) -> None:
    target = worker_id_hex(cluster.instance_ids()[1])
    proc = subprocess.Popen([sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", cluster.file_kv, "watch", "--json",
                             "--duration", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[dict] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # The initial listing shows up as registrations; then the drain happens live.
        wait_until(lambda: sum(1 for e in lines if e["kind"] == "registered") >= 3, 30, what="registrations")
        assert ctl(cluster, "drain", target).returncode == 0
        wait_until(lambda: any(e["kind"] == "drain" and e["instance_id"] == target for e in lines), 30, what="drain event")
        assert ctl(cluster, "wake", target).returncode == 0
        wait_until(lambda: any(e["kind"] == "wake" and e["instance_id"] == target for e in lines), 30, what="wake event")
    finally:
        proc.terminate()
        proc.wait(10)
    raw = ctl(cluster, "watch", "--raw", "--duration", "2.5")
    assert raw.returncode == 0
    state = replay([json.loads(x) for x in raw.stdout.splitlines()])
    assert {w.instance_id for w in state.worker_list()} == set(cluster.instance_ids())
    assert all(w.stats.loads for w in state.worker_list())  # load metrics were recorded too


def test_installed_script() -> None:
    exe = shutil.which("dynamoctl")
    if exe is None:
        pytest.skip("dynamoctl console script not installed (pip install -e .)")
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "cluster" in res.stdout
