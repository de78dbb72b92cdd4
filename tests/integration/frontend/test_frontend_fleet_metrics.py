"""``--num-frontends 2``: the shared port's ``/metrics`` adds up the whole fleet, whichever process
answers; each member's own ``/metrics`` (advertised in discovery) counts only itself; ``dynamoctl
trace`` finds a request's frontend spans whichever member served it (each member's status server
serves its ``/v1/traces``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import (
    CLI,
    LocalCluster,
    Proc,
    clean_env,
    cluster_fixture,
    get_json,
    pid_gone,
)

pytestmark = pytest.mark.timeout(180)


cluster = cluster_fixture("fleet-metrics", workers=1)


def _requests_total(text: str) -> float:
    """Successful completions requests in one exposition (0 when none yet)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "dynamo_frontend_requests":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("status") == "success":
                    total += sample.value
    return total


def _gauge(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return family.samples[0].value
    return None


def _member_metrics_urls(file_kv: Path, fleet: str) -> list[str]:
    """The ``metrics_url`` labels of the fleet's frontend records in file discovery."""
    urls = []
    for path in (file_kv / "keys").glob("v1%2Finstances%2F*%2Ffrontend%2Fhttp%2F*"):
        lines = path.read_text().splitlines()
        record = json.loads(lines[-1]) if lines else {}
        labels = record.get("labels") or {}
        if labels.get("fleet") == fleet:
            urls.append(labels["metrics_url"])
    return sorted(urls)


@pytest.mark.parametrize("started_by", ["num-frontends", "up"])
def test_fleet_metrics_add_up_every_member(cluster: LocalCluster, started_by: str) -> None:
    port = free_port()
    base = [*CLI, "--role", "frontend", *cluster.runtime_flags(), "--http-port", str(port)]
    if started_by == "num-frontends":  # one process starts its copy
        procs = [Proc("fleet-metrics", [*base, "--num-frontends", "2"], cluster.env, cluster.root)]
    else:  # `dynamod up --num-frontends 2`: two independent processes on one port
        procs = [Proc(f"fleet-metrics-{i}", [*base, "--reuse-port"], cluster.env, cluster.root) for i in range(2)]
    url = f"http://127.0.0.1:{port}"
    group: list[int] = []
    try:
        def group_pids() -> list[int] | None:
            pids = get_json(url + "/health")["frontend_pids"]
            return pids if len(pids) == 2 else None

        def member_urls() -> list[str] | None:
            urls = _member_metrics_urls(cluster.file_kv, url)
            return urls if len(urls) == 2 else None

        group = wait_until(group_pids, 30, what="both frontends to start")
        members = wait_until(member_urls, 30, what="both members to advertise their own /metrics")
        assert all(f":{port}/" not in m for m in members), "a member's own /metrics must not be the shared port"

        # Fresh connections spread requests over both processes; each request counts once.
        answered_by: set[int] = set()
        sent = 0
        while answered_by != set(group) or sent < 6:
            with httpx.Client(base_url=url, timeout=30) as fresh:
                reply = fresh.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
                )
                assert reply.status_code == 200, reply.text
                answered_by.add(fresh.get("/health").json()["pid"])
            sent += 1
            assert sent < 60, "connections never reached both processes"

        per_member = [_requests_total(httpx.get(m, timeout=5).text) for m in members]
        assert sum(per_member) == sent and all(n > 0 for n in per_member), per_member

        # Whichever process answers the shared port, /metrics is the fleet: the sum, not one share.
        for _ in range(6):
            with httpx.Client(base_url=url, timeout=10) as fresh:
                text = fresh.get("/metrics").text
            assert _requests_total(text) == sent
            assert _gauge(text, "dynamo_frontend_fleet_members") == 2
        with httpx.Client(base_url=url, timeout=10) as fresh:
            alone = fresh.get("/metrics", params={"scope": "process"}).text
        assert _requests_total(alone) in per_member and _gauge(alone, "dynamo_frontend_fleet_members") is None
    finally:
        codes = [proc.stop() for proc in procs]
        assert codes == [0] * len(procs)
    for pid in group:
        wait_until(lambda pid=pid: pid_gone(pid), 15, what=f"frontend {pid} to exit")


def test_dynamoctl_trace_finds_the_frontend_spans_whichever_member_served(cluster: LocalCluster) -> None:
    port = free_port()
    argv = [*CLI, "--role", "frontend", *cluster.runtime_flags(), "--http-port", str(port), "--num-frontends", "2"]
    proc = Proc("fleet-traces", argv, cluster.env | {"DYN_TRACE_SAMPLE_RATE": "1.0"}, cluster.root)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: len(get_json(url + "/health")["frontend_pids"]) == 2 or None, 30, what="both frontends")
        wait_until(lambda: len(_member_metrics_urls(cluster.file_kv, url)) == 2 or None, 30, what="both members advertised")
        served: dict[int, str] = {}  # member pid -> a request id it served
        sent = 0
        while len(served) < 2:
            rid = f"fleet-trace-{sent}"
            with httpx.Client(base_url=url, timeout=30) as fresh:  # one connection: one member
                reply = fresh.post("/v1/completions", headers={"x-request-id": rid},
                                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
                assert reply.status_code == 200, reply.text
                served.setdefault(fresh.get("/health").json()["pid"], rid)
            sent += 1
            assert sent < 60, "connections never reached both processes"
        for pid, rid in served.items():
            done = subprocess.run(
                [sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(cluster.file_kv), "trace", rid, "--json"],
                env=clean_env(cluster.file_kv), capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, (pid, done.stderr)
            assert "404" not in done.stderr, done.stderr  # every member was read, none refused the path
            spans = json.loads(done.stdout)["spans"]
            by_id = {s["span_id"]: s for s in spans}
            [root] = [s for s in spans if s["parent_id"] is None]
            assert root["name"] == "http-request" and root["component"] == "frontend", root
            assert root["attributes"]["request_id"] == rid
            assert {"client_request", "route"} <= {s["name"] for s in spans if s["component"] == "frontend"}, spans
            assert any(s["component"] == "agg" for s in spans), spans  # the worker's spans, in the same trace
            assert all(s["parent_id"] is None or s["parent_id"] in by_id for s in spans), spans
    finally:
        assert proc.stop() == 0
