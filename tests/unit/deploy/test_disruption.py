"""Scale-down, eviction and node loss lose no request (issue 28, item 2): a PodDisruptionBudget
for the frontends and every worker pool, a worker preStop that drains and waits for in-flight
requests within terminationGracePeriodSeconds, and frontends spread over nodes and zones.

The preStop script itself runs here against a real worker of a ``dynamod up`` cluster with the
cluster token on (its port and discovery in place of the pod's): the worker must end up
``draining`` and the script exit 0.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.servers import free_port, wait_until
from tests.unit.deploy.conftest import OVERLAYS, rendered
from tests.unit.deploy.kustomize_lite import pod_spec, resource_id

POOLS = ("agg", "prefill", "decode")
MARGIN_S = 10  # what is left for the runtime to close after both drains


def _deployments(overlay: str) -> list[dict[str, Any]]:
    return [d for d in rendered(overlay) if d["kind"] == "Deployment"]


def _component(doc: dict[str, Any]) -> str:
    return doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def _flag(args: list[str], name: str) -> str | None:
    return next((args[i + 1] for i, a in enumerate(args[:-1]) if a == name), None)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_frontends_and_every_worker_pool_have_a_disruption_budget(overlay: str) -> None:
    docs = rendered(overlay)
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for dep in _deployments(overlay):
        if _component(dep) not in ("frontend", *POOLS):
            continue
        labels = dep["spec"]["template"]["metadata"]["labels"]
        matching = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, f"{resource_id(dep)}: {len(matching)} PodDisruptionBudgets select it"
        spec = matching[0]["spec"]
        assert spec.get("maxUnavailable") == 1 and "minAvailable" not in spec, "one at a time, never blocking a drain"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_prestop_drains_within_the_grace_period(overlay: str) -> None:
    workers = [d for d in _deployments(overlay) if _component(d) in POOLS]
    assert workers
    for dep in workers:
        pod = pod_spec(dep)
        (c,) = pod["containers"]
        script = c["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert "dynamoctl" in script and " drain " in script and "--wait" in script
        drain_s = float(script.split("--drain-timeout")[1].split()[0])
        shutdown_s = float(_flag(c["args"], "--shutdown-grace") or 30)
        grace = pod["terminationGracePeriodSeconds"]
        assert drain_s + shutdown_s + MARGIN_S <= grace, (
            f"{resource_id(dep)}: preStop {drain_s}s + --shutdown-grace {shutdown_s}s + {MARGIN_S}s > {grace}s: "
            "the kubelet would SIGKILL a worker that is still finishing requests"
        )
        assert f"127.0.0.1:{_flag(c['args'], '--system-port')}/health" in script


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_frontends_spread_over_nodes_and_zones(overlay: str) -> None:
    (fe,) = [d for d in _deployments(overlay) if _component(d) == "frontend"]
    labels = fe["spec"]["template"]["metadata"]["labels"]
    constraints = pod_spec(fe)["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in constraints} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for c in constraints:
        assert c["labelSelector"]["matchLabels"].items() <= labels.items()
        assert c["whenUnsatisfiable"] == "ScheduleAnyway", "a one-node dev cluster must still schedule"
    (c,) = pod_spec(fe)["containers"]
    sleep_s = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert sleep_s + float(_flag(c["args"], "--shutdown-grace") or 30) < pod_spec(fe)["terminationGracePeriodSeconds"]


TOKEN = "prestop-test-cluster-token-0123456789"


def _health(port: int) -> dict:
    """The worker's /health with its endpoints (shown to members: the cluster token)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.timeout(90)
def test_prestop_script_drains_a_real_worker(tmp_path: Path) -> None:
    from tests.fixtures.daemons import Up, up_command
    from tests.integration.frontend.test_frontend_support import clean_env

    (dep,) = [d for d in _deployments("dev") if _component(d) == "agg"]
    (c,) = pod_spec(dep)["containers"]
    script = c["lifecycle"]["preStop"]["exec"]["command"][-1]
    file_kv = tmp_path / "discovery"
    sd = tmp_path / "targets.json"
    token = tmp_path / "cluster.token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    up = Up(up_command("--http-port", str(free_port()), "--workers", "1", "--file-kv", str(file_kv),
                        "--log-dir", str(tmp_path / "logs"), "--prometheus-sd", str(sd),
                        "--cluster-token-file", str(token)),
            clean_env(file_kv), cwd=tmp_path)
    try:
        up.wait_up(60)
        groups = wait_until(lambda: [g for g in json.loads(sd.read_text()) if g["labels"]["role"] == "agg"], 20)
        port = int(groups[0]["targets"][0].rsplit(":", 1)[1])
        assert _health(port)["endpoints"][0]["status"] == "ready"
        # The pod's script with this worker's status port; discovery from the environment, as in the pod.
        # With the cluster token on, as a secured pod runs: /health shows the id, drain needs the token.
        env = {**clean_env(file_kv), "DYN_DISCOVERY_BACKEND": "file", "DYN_CLUSTER_TOKEN_FILE": str(token)}
        result = subprocess.run(["sh", "-c", script.replace("127.0.0.1:9090", f"127.0.0.1:{port}")],
                                env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert {e["status"] for e in _health(port)["endpoints"]} == {"draining"}
        up.proc.send_signal(2)
        assert up.proc.wait(60) == 0
    finally:
        up.kill()
    assert json.loads(sd.read_text()) == [], "a stopped cluster leaves no targets"
