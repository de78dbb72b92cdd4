"""deploy/prometheus/prometheus.yml: it parses, has the jobs the dashboard relies on, scrapes the
namespace the manifests use, and its relabelling turns a pod's annotations into the right target."""

from __future__ import annotations

import re

import yaml

from tests.unit.deploy.conftest import DEPLOY, OVERLAYS, rendered
from tests.unit.deploy.kustomize_lite import CLUSTER_SCOPED

CONFIG = DEPLOY / "prometheus" / "prometheus.yml"


def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def _job(name: str) -> dict:
    (job,) = [j for j in _config()["scrape_configs"] if j["job_name"] == name]
    return job


def test_config_has_the_expected_jobs() -> None:
    config = _config()
    assert {j["job_name"] for j in config["scrape_configs"]} == {"dynamod-pods", "prometheus"}
    assert config["global"]["scrape_interval"]


def test_pods_job_discovers_annotated_pods_in_the_dynamod_namespace() -> None:
    job = _job("dynamod-pods")
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod"
    namespaces = {
        d["metadata"]["namespace"] for o in OVERLAYS for d in rendered(o) if d["kind"] not in CLUSTER_SCOPED
    }
    assert namespaces <= set(sd["namespaces"]["names"])
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep", "regex": "true"} in keep
    targets = {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}
    assert {"__metrics_path__", "__address__", "namespace", "pod", "component"} <= targets


def test_address_relabelling_uses_the_annotated_port() -> None:
    (rule,) = [r for r in _job("dynamod-pods")["relabel_configs"] if r.get("target_label") == "__address__"]
    assert rule["source_labels"] == ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"]
    regex = re.compile(rule["regex"])
    replacement = rule["replacement"].replace("$1", r"\1").replace("$2", r"\2")
    for address, port, want in (("10.1.2.3:8000", "9090", "10.1.2.3:9090"), ("10.1.2.3", "8000", "10.1.2.3:8000")):
        joined = f"{address};{port}"
        assert regex.fullmatch(joined), joined
        assert regex.sub(replacement, joined) == want


def _cluster_secret_mounts() -> set[str]:
    """Where the rendered dynamod pods mount the ``dynamod-cluster-secrets`` Secret."""
    mounts = set()
    for overlay in OVERLAYS:
        for doc in rendered(overlay):
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            volumes = {
                v["name"] for v in pod.get("volumes", [])
                if v.get("secret", {}).get("secretName") == "dynamod-cluster-secrets"
            }
            for container in pod.get("containers", []):
                mounts |= {m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in volumes}
    return mounts


def test_pods_job_sends_the_cluster_token_from_the_secret_file() -> None:
    """Status servers refuse /metrics without the cluster token: the job must send it, from the same
    Secret key and mount path the dynamod pods use (README's ``--from-file=cluster.token=...``)."""
    auth = _job("dynamod-pods")["authorization"]
    assert auth["type"] == "Bearer"
    assert "credentials" not in auth, "the token belongs in a file, not in the config"
    directory, _, name = auth["credentials_file"].rpartition("/")
    assert name == "cluster.token"
    assert _cluster_secret_mounts() == {directory}
    readme = (DEPLOY / "kubernetes" / "README.md").read_text()
    assert "--from-file=cluster.token=" in readme and f"DYN_CLUSTER_TOKEN_FILE={auth['credentials_file']}" in readme


def test_prometheus_self_scrape_sends_no_token() -> None:
    assert "authorization" not in _job("prometheus")
