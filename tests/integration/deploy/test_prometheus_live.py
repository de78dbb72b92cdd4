"""A real Prometheus scrapes a live ``dynamod up`` through the file ``--prometheus-sd`` keeps
(issue 28, item 5), with the cluster token on.

One disaggregated cluster with a planner (frontend, a prefill worker, two decode workers, the
planner), so the disaggregation, KV transfer and planner panels have series too. After traffic:
every metric a panel of deploy/grafana/dynamod-dashboard.json queries has data (except the few
counters that only move on a failure, listed with their reason), each panel's full PromQL
evaluates without error, and killing a decode worker fires ``DynamodWorkerDown``.

Prometheus is Debian's ``prometheus`` package (scripts/test.sh installs it); without it the test
skips and says so. Its config is deploy/prometheus/prometheus-file-sd.yml and its rules
deploy/prometheus/rules.yml, loaded as shipped except: 1 s scrape and evaluation intervals, this
run's paths, and ``for: 0s`` on DynamodWorkerDown (the shipped 1 m would make the test a minute
longer; promtool's unit tests cover the ``for``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fixtures.daemons import Up, up_command
from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import clean_env
from tests.unit.deploy import promql

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dynamod-dashboard.json"
TOKEN = "prometheus-live-test-token-0123456789"
NAMESPACE = "dynamo"
MODEL = "tiny"

# Counters that get a series only when something fails; the unit tests check they are exported.
FAILURE_ONLY = {
    "dynamo_component_kv_transfer_failures_total": "a decode worker failed to pull KV blocks",
    "dynamo_frontend_prefill_failures_total": "a remote prefill failed",
    "dynamo_component_kv_hold_expired_total": "a prefill worker's held blocks were never collected",
    "dynamo_component_errors_total": "an endpoint handler failed",
}


@dataclass
class Live:
    up: Up
    port: int
    prometheus: str
    sd_file: Path

    def query(self, expr: str) -> dict:
        reply = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", f"{expr}: {reply.status_code} {body}"
        return body["data"]

    def series(self, expr: str) -> list[dict]:
        return self.query(expr)["result"]


def _prometheus_config(root: Path, sd_file: Path, token_file: Path, port: int) -> Path:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus-file-sd.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
    rules = (PROMETHEUS_DIR / "rules.yml").read_text()
    rules, n = re.subn(r"(alert: DynamodWorkerDown\n(?:.*\n)*?\s+for: )1m", r"\g<1>0s", rules)
    assert n == 1, "rules.yml: DynamodWorkerDown's `for: 1m` not found"
    (root / "rules.yml").write_text(rules)
    config["rule_files"] = [str(root / "rules.yml")]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "dynamod"]
    job["authorization"]["credentials_file"] = str(token_file)
    job["file_sd_configs"][0]["files"] = [str(sd_file)]
    job["file_sd_configs"][0]["refresh_interval"] = "1s"
    (own,) = [j for j in config["scrape_configs"] if j["job_name"] == "prometheus"]
    own["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
    path = root / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` binary is not installed (Debian package prometheus; scripts/test.sh installs it)")
    root = tmp_path_factory.mktemp("prometheus-live")
    token_file = root / "cluster.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    sd_file = root / "targets.json"
    file_kv = root / "discovery"
    port, prom_port = free_port(), free_port()
    up = Up(
        up_command(
            "--http-port", str(port), "--prefill-workers", "1", "--decode-workers", "2",
            "--planner", "load", "--min-workers", "1", "--max-workers", "2",
            "--speedup-ratio", "20", "--file-kv", str(file_kv), "--log-dir", str(root / "logs"),
            "--ready-timeout", "60", "--crash-limit", "1", "--cluster-token-file", str(token_file),
            "--prometheus-sd", str(sd_file),
            # After the kill mid-stream some child waits out its whole grace when stopped (30 s of
            # teardown with the default); shutdown is not what this test is about.
            "--shutdown-grace", "5",
        ),
        clean_env(file_kv), cwd=root,
    )
    config = _prometheus_config(root, sd_file, token_file, prom_port)
    prom = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(root / "prometheus.log", "w"),  # noqa: SIM115 - closed with the process
    )
    try:
        up.wait_up(60)
        yield Live(up, port, f"http://127.0.0.1:{prom_port}", sd_file)
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.output[-3000:]
        assert json.loads(sd_file.read_text()) == [], "a stopped cluster leaves no targets behind"
    finally:
        up.kill()
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()


def _traffic(base: str) -> None:
    """Streams with a shared prefix (KV hits), a non-streamed request, and one stream the client
    drops half way (client disconnects)."""
    prefix = "You are a helpful assistant. " * 20
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(6):
            body = {"model": MODEL, "stream": True, "max_tokens": 12,
                    "messages": [{"role": "user", "content": f"{prefix} question {i % 2}"}]}
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                assert any("[DONE]" in line for line in resp.iter_lines())
        reply = client.post("/v1/completions", json={"model": MODEL, "prompt": prefix, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        body = {"model": MODEL, "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": "long"}]}
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            for n, _line in enumerate(resp.iter_lines()):
                if n > 3:
                    break  # leaving the block closes the connection mid-stream


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$namespace", NAMESPACE).replace("$model", MODEL)
                    .replace("$__rate_interval", "1m"))
            out.append((f"{panel['title']} / {target['refId']}", expr))
    return out


def _variable_queries() -> list[tuple[str, str]]:
    """The dashboard's ``label_values(selector, label)`` variables, with ``$namespace`` filled in."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            selector, label = promql.label_values_query(query)
            out.append((selector.replace('"$namespace"', f'"{NAMESPACE}"'), label))
    return out


def _kill_during_stream(live: Live, pid: int) -> None:
    """Kills ``pid`` while a long stream is running, so the frontend migrates what it can."""
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 120, "messages": [{"role": "user", "content": "migrate me"}]}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{live.port}/v1/chat/completions", json=body, timeout=60) as resp:
                for n, _line in enumerate(resp.iter_lines()):
                    if n == 2:
                        started.set()
        except httpx.HTTPError:
            pass
        started.set()

    streams = [threading.Thread(target=stream) for _ in range(2)]  # round-robin: one lands on each decode worker
    for t in streams:
        t.start()
    assert started.wait(30)
    os.kill(pid, signal.SIGKILL)
    for t in streams:
        t.join(60)


def test_prometheus_scrapes_the_cluster_panels_have_data_and_a_killed_worker_alerts(live: Live) -> None:
    # Prometheus finds every process of the cluster through the file, and the token gets it in.
    groups = wait_until(lambda: (g := json.loads(live.sd_file.read_text())) and len(g) >= 5 and g, 30, what="sd file")
    roles = sorted(g["labels"]["role"] for g in groups)
    assert {"frontend", "prefill", "decode", "planner"} <= set(roles), roles
    wait_until(lambda: len(live.series('up{job="dynamod"} == 1')) == len(groups), 30, what="every target up")

    _traffic(f"http://127.0.0.1:{live.port}")
    decode = {g["labels"]["worker_name"]: g for g in groups if g["labels"]["role"] == "decode"}
    victim = decode["decode-0"]
    pid = int(re.findall(r"child started name=decode-0 pid=(\d+)", live.up.output)[-1])
    _kill_during_stream(live, pid)

    # Every metric the dashboard queries has a series, labelled with the target's namespace.
    queries = _dashboard_queries()
    metrics = sorted({m for _, expr in queries for m in promql.metric_names(expr)} - set(FAILURE_ONLY))

    def missing() -> list[str]:
        return [m for m in metrics if not live.series(f'count({m}{{namespace="{NAMESPACE}"}})')]

    try:
        wait_until(lambda: not missing(), 30, what="a series for every dashboard metric")
    except Exception:
        pytest.fail(f"dashboard metrics without data after traffic: {missing()}")
    # Each panel's whole expression evaluates without error (Live.query asserts it) and, unless it
    # reads a failure-only counter, to at least one series.
    empty = [where for where, expr in queries if not live.query(expr)["result"] and not promql.metric_names(expr) & set(FAILURE_ONLY)]
    assert not empty, f"panels that evaluate to nothing after traffic: {empty}"
    for selector, label in _variable_queries():
        values = httpx.get(f"{live.prometheus}/api/v1/label/{label}/values", params={"match[]": selector}, timeout=10).json()
        assert (NAMESPACE if label == "namespace" else MODEL) in values["data"], (selector, label, values)

    # The killed worker stays in the file (the supervisor gave up on it: --crash-limit 1), its
    # scrape fails, and the alert fires for it by name.
    (address,) = victim["targets"]

    def firing() -> list[dict]:
        alerts = httpx.get(f"{live.prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "DynamodWorkerDown" and a["state"] == "firing"]

    alerts = wait_until(firing, 30, what="DynamodWorkerDown firing")
    (alert,) = alerts
    assert alert["labels"]["instance"] == address
    assert alert["labels"]["worker_name"] == "decode-0" and alert["labels"]["role"] == "decode"
    assert alert["labels"]["model"] == MODEL and alert["labels"]["namespace"] == NAMESPACE
    assert any(g["targets"] == [address] for g in json.loads(live.sd_file.read_text()))
