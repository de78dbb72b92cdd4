"""deploy/prometheus/rules.yml: promtool accepts it and its unit tests (rules_test.yml) pass, every
series it reads is one the daemons export (or a recording rule of the same file), every label it
groups by reaches Prometheus, both Prometheus configs load it, and the Kubernetes PrometheusRule
carries exactly the same groups.

Regenerate the PrometheusRule after editing rules.yml:  python -m tests.unit.deploy.test_alerts --write
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy import promql
from tests.unit.deploy.conftest import DEPLOY
from tests.unit.deploy.exported_metrics import ExportedMetrics, exported_metrics

RULES = DEPLOY / "prometheus" / "rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "rules_test.yml"
PROMETHEUS_RULE = DEPLOY / "kubernetes" / "monitoring" / "prometheus-rule.yaml"
# What the issue asks the rules to cover, by alert name.
REQUIRED_ALERTS = {
    "worker down": "DynamodWorkerDown",
    "no ready worker for a model": "DynamodNoReadyWorker",
    "TTFT SLO burn rate": "DynamodTTFTBudgetBurnFast",
    "ITL SLO burn rate": "DynamodITLBudgetBurnFast",
    "KV transfer failures": "DynamodKVTransferFailures",
    "migrations spiking": "DynamodMigrationsSpiking",
    "planner stuck below desired replicas": "DynamodPlannerBelowDesired",
}
# Labels every target gets from the scrape configs (file_sd groups; Kubernetes relabelling) or from
# Prometheus itself.
TARGET_LABELS = {"namespace", "role", "model", "component", "worker_id", "worker_name", "instance", "job"}


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@cache
def _exported() -> ExportedMetrics:
    return exported_metrics()


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/test.sh installs it)")
    return path


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    result = subprocess.run([_promtool(), "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_the_issue_asks_for_exists_and_is_unit_tested() -> None:
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    tested = {case["alertname"] for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for case in test.get("alert_rule_test", []) if case.get("exp_alerts")}
    for what, name in REQUIRED_ALERTS.items():
        assert name in alerts, f"no alert for {what}"
    assert alerts <= tested, f"alerts never seen firing in rules_test.yml: {sorted(alerts - tested)}"


def test_every_alert_has_a_severity_and_a_summary() -> None:
    for rule in _rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_every_series_the_rules_read_is_exported_or_recorded() -> None:
    recorded = {r["record"] for r in _rules() if "record" in r}
    series = _exported().series
    missing = {}
    for rule in _rules():
        for name in promql.metric_names(rule["expr"]) - recorded - {"up"}:
            if name not in series:
                missing.setdefault(name, []).append(rule.get("alert") or rule.get("record"))
    assert not missing, f"series no dynamod collector registers: {missing}"


def test_every_label_the_rules_use_exists() -> None:
    exported = _exported()
    problems = []
    for rule in _rules():
        names = promql.metric_names(rule["expr"])
        known = set(TARGET_LABELS) | ({"le"} if any(n.endswith("_bucket") for n in names) else set())
        for name in names:
            if name in exported.series:
                known |= exported.labels[exported.series[name]]
        for label in promql.label_names(rule["expr"]) - known:
            problems.append(f"{rule.get('alert') or rule.get('record')}: label {label!r}")
    assert not problems, problems


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-file-sd.yml"])
def test_both_prometheus_configs_load_the_rules(config: str) -> None:
    loaded = yaml.safe_load((DEPLOY / "prometheus" / config).read_text())
    assert "rules.yml" in loaded["rule_files"]


def test_both_scrape_configs_give_targets_the_labels_the_rules_use() -> None:
    """Kubernetes: relabelled from pod metadata; file_sd: the labels dynamod writes (see test_targets)."""
    k8s = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in k8s["scrape_configs"] if j["job_name"] == "dynamod-pods"]
    relabelled = {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}
    assert {"namespace", "role"} <= relabelled


def prometheus_rule() -> dict[str, Any]:
    """The PrometheusRule (Prometheus Operator) carrying rules.yml's groups unchanged."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "dynamod",
            "namespace": "dynamod",
            "labels": {"app.kubernetes.io/name": "dynamod", "app.kubernetes.io/part-of": "dynamod",
                       "app.kubernetes.io/component": "monitoring"},
        },
        "spec": {"groups": yaml.safe_load(RULES.read_text())["groups"]},
    }


def render_prometheus_rule() -> str:
    header = ("# Generated from deploy/prometheus/rules.yml (do not edit; after changing the rules run\n"
              "#   python -m tests.unit.deploy.test_alerts --write\n"
              "# tests/unit/deploy/test_alerts.py fails while the two differ).\n")
    class BlockDumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        # Multi-line PromQL as a literal block, as in rules.yml, so the file stays readable.
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    BlockDumper.add_representer(str, text)
    return header + yaml.dump(prometheus_rule(), Dumper=BlockDumper, sort_keys=False, width=120)


def test_kubernetes_prometheus_rule_equals_rules_yml() -> None:
    assert PROMETHEUS_RULE.exists(), "run: python -m tests.unit.deploy.test_alerts --write"
    assert yaml.safe_load(PROMETHEUS_RULE.read_text()) == prometheus_rule(), (
        "deploy/kubernetes/monitoring/prometheus-rule.yaml is stale: python -m tests.unit.deploy.test_alerts --write"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        Path(PROMETHEUS_RULE).parent.mkdir(parents=True, exist_ok=True)
        PROMETHEUS_RULE.write_text(render_prometheus_rule())
        print(f"wrote {PROMETHEUS_RULE}")
    else:
        sys.exit("usage: python -m tests.unit.deploy.test_alerts --write")
