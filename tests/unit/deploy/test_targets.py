"""Prometheus file_sd from discovery (issue 28, item 3): ``shared/observability/file_sd.py``,
``dynamoctl targets`` over a real file-discovery directory, the sticky targets of ``dynamod up
--prometheus-sd`` (``daemon/supervisor/prometheus_sd.py``), and promtool accepting the shipped
file_sd scrape config. The live path (a real Prometheus scraping ``dynamod up`` through the file)
is tests/integration/deploy/test_prometheus_live.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dynamod.console.ctl.main import main as dynamoctl
from dynamod.daemon.supervisor.prometheus_sd import PrometheusSdWriter
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.observability.file_sd import target_group, target_groups, write_file
from dynamod.shared.protocol.instance import Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key
from tests.unit.deploy.conftest import DEPLOY


def _worker(iid: int, endpoint: str = "generate", *, port: int = 9101, name: str = "worker-0", ns: str = "dynamo") -> Instance:
    return Instance(namespace=ns, component="backend", endpoint=endpoint, instance_id=iid, transport="tcp",
                    address="127.0.0.1:40000", role="agg", model="tiny", labels={"worker_name": name},
                    system_url=f"http://127.0.0.1:{port}")


def _frontend(iid: int = 0xF1, url: str = "http://10.0.0.5:8000/metrics") -> Instance:
    return Instance(namespace="dynamo", component="frontend", endpoint="http", instance_id=iid, transport="http",
                    address="10.0.0.5:8000", role="frontend", labels={"metrics_url": url})


def test_a_worker_is_one_target_with_the_labels_the_dashboard_and_rules_use() -> None:
    endpoints = ("generate", "drain", "sleep", "kv_dump")
    groups = target_groups([_worker(0xA1, e) for e in endpoints])
    assert groups == [{
        "targets": ["127.0.0.1:9101"],
        "labels": {"__metrics_path__": "/metrics", "__scheme__": "http", "namespace": "dynamo", "component": "backend",
                   "role": "agg", "worker_id": "00000000000000a1", "model": "tiny", "worker_name": "worker-0"},
    }]


def test_frontend_uses_its_metrics_url_and_https_and_ipv6_are_kept() -> None:
    (group,) = target_groups([_frontend()])
    assert group["targets"] == ["10.0.0.5:8000"] and group["labels"]["role"] == "frontend"
    assert "model" not in group["labels"], "a frontend serves every model: its series carry their own"
    https = target_group(_frontend(url="https://[fd00::5]:8443/metrics"))
    assert https is not None
    assert https["targets"] == ["[fd00::5]:8443"] and https["labels"]["__scheme__"] == "https"


def test_instances_without_metrics_are_left_out_and_order_is_stable() -> None:
    silent = Instance(namespace="dynamo", component="router", endpoint="generate", instance_id=7, transport="tcp",
                      address="127.0.0.1:1")
    a, b = _worker(1, port=9102, name="worker-1"), _worker(2, port=9101, name="worker-0")
    assert target_group(silent) is None
    assert target_groups([a, b, silent]) == target_groups([silent, b, a])
    assert [g["targets"] for g in target_groups([a, b])] == [["127.0.0.1:9101"], ["127.0.0.1:9102"]]


def test_write_file_is_atomic_and_only_writes_changes(tmp_path: Path) -> None:
    path = tmp_path / "sd" / "targets.json"
    groups = target_groups([_worker(1)])
    assert write_file(path, groups) is True
    assert json.loads(path.read_text()) == groups
    assert write_file(path, groups) is False
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"], "no temporary file left behind"


async def _publish(file_kv: Path, instances: list[Instance]) -> None:
    store = make_store("file", file_root=str(file_kv))
    await store.start()
    try:
        for inst in instances:
            await store.put(instance_key(inst.namespace, inst.component, inst.endpoint, inst.instance_id),
                            encode_instance(inst))
    finally:
        await store.close()


def test_dynamoctl_targets_reads_discovery(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file_kv = tmp_path / "discovery"
    asyncio.run(_publish(file_kv, [_worker(0xA1), _worker(0xA1, "drain"), _frontend(),
                                   _worker(0xB2, port=9200, name="worker-0", ns="other")]))
    conn = ["--discovery", "file", "--file-kv", str(file_kv)]

    assert dynamoctl([*conn, "targets", "--prometheus"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert sorted(g["targets"][0] for g in groups) == ["10.0.0.5:8000", "127.0.0.1:9101", "127.0.0.1:9200"]

    assert dynamoctl([*conn, "--namespace", "other", "targets", "--prometheus", "-o", str(tmp_path / "t.json")]) == 0
    assert capsys.readouterr().out == ""
    (only,) = json.loads((tmp_path / "t.json").read_text())
    assert only["targets"] == ["127.0.0.1:9200"] and only["labels"]["namespace"] == "other"

    assert dynamoctl([*conn, "targets"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["TARGET", "NAMESPACE", "ROLE"] and len(table) == 4


def test_dynamoctl_targets_refuses_an_empty_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conn = ["--discovery", "file", "--file-kv", str(tmp_path / "empty")]
    assert dynamoctl([*conn, "targets", "--prometheus", "-o", str(tmp_path / "t.json")]) == 1
    assert "no instance with a /metrics address" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists(), "an empty file would drop every target Prometheus had"
    assert dynamoctl([*conn, "targets", "--prometheus", "--allow-empty"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert dynamoctl([*conn, "targets", "-o", str(tmp_path / "t.json")]) == 2


def _supervisor(*names: str, retiring: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(children=[SimpleNamespace(spec=SimpleNamespace(name=n), retiring=n in retiring) for n in names])


def test_up_keeps_a_wanted_worker_listed_after_it_left_discovery(tmp_path: Path) -> None:
    sup = _supervisor("frontend", "worker-0", "worker-1")
    writer = PrometheusSdWriter(sup, tmp_path / "t.json", str(tmp_path), "dynamo")  # type: ignore[arg-type]
    w0, w1, fe = _worker(1, port=9101, name="worker-0"), _worker(2, port=9102, name="worker-1"), _frontend()
    assert len(writer.groups(target_groups([w0, w1, fe]))) == 3
    # worker-0 crashed: gone from discovery, still wanted -> still a target (its `up` goes to 0).
    kept = writer.groups(target_groups([w1, fe]))
    assert sorted(g["targets"][0] for g in kept) == ["10.0.0.5:8000", "127.0.0.1:9101", "127.0.0.1:9102"]
    # Restarted under a new instance id at the same address: one target, the new one.
    back = writer.groups(target_groups([_worker(3, port=9101, name="worker-0"), w1, fe]))
    assert [g["labels"]["worker_id"] for g in back if g["targets"] == ["127.0.0.1:9101"]] == ["0000000000000003"]
    # Retired by the scaler: it leaves the file once out of discovery.
    sup.children[2].retiring = True
    assert sorted(g["targets"][0] for g in writer.groups(target_groups([_worker(3, port=9101), fe]))) == [
        "10.0.0.5:8000", "127.0.0.1:9101"]


def test_promtool_accepts_the_file_sd_scrape_config(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/test.sh installs it)")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-file-sd.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "dynamod"]
    assert job["honor_labels"] is True, "worker_id/model of the series must win over the target's"
    token = tmp_path / "cluster.token"
    token.write_text("x" * 32)
    job["authorization"]["credentials_file"] = str(token)
    (tmp_path / "targets.json").write_text(json.dumps(target_groups([_worker(1), _frontend()])))
    job["file_sd_configs"][0]["files"] = [str(tmp_path / "targets.json")]
    shutil.copy(DEPLOY / "prometheus" / "rules.yml", tmp_path / "rules.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
