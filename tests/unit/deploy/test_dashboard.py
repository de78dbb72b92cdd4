"""deploy/grafana/dynamod-dashboard.json queries only what the daemons export: every metric name
in every panel and variable query is a series some dynamod collector registers (read from the
collectors, see exported_metrics.py), and every label it groups, filters or names in a legend is
one of that metric's labels or one the Prometheus scrape config adds."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
import yaml

from tests.unit.deploy import promql
from tests.unit.deploy.conftest import DEPLOY
from tests.unit.deploy.exported_metrics import ExportedMetrics, exported_metrics

DASHBOARD = DEPLOY / "grafana" / "dynamod-dashboard.json"

# The planner's series the dashboard's replicas panel needs, with their labels. The planner role
# (daemon/planner/metrics.py) must export exactly these.
PLANNER_METRICS = {"dynamo_planner_desired_replicas": {"pool"}, "dynamo_planner_current_replicas": {"pool"}}

# What the issue asks the dashboard to show, by the series that carry it.
REQUIRED = {
    "request rate": "dynamo_frontend_requests_total",
    "TTFT percentiles": "dynamo_frontend_time_to_first_token_seconds_bucket",
    "ITL percentiles": "dynamo_frontend_inter_token_latency_seconds_bucket",
    "KV usage per worker": "dynamo_component_kv_cache_usage_percent",
    "hit rate per worker": "dynamo_component_prefix_cache_hit_rate",
    "queue depth": "dynamo_component_waiting_requests",
    "KV transfer rate": "dynamo_component_kv_transfer_bytes_total",
    "disagg decisions": "dynamo_frontend_disagg_decisions_total",
    "planner desired replicas": "dynamo_planner_desired_replicas",
    "planner current replicas": "dynamo_planner_current_replicas",
}


@cache
def _exported() -> ExportedMetrics:
    return exported_metrics()


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries() -> list[tuple[str, str, str]]:
    """(where, expr, legend) for every panel target and every query variable."""
    out = []
    for panel in _dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"], target.get("legendFormat", "")))
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            selector, label = promql.label_values_query(query)
            out.append((f"variable ${var['name']}", selector, "{{" + label + "}}"))
    return out


def _target_labels() -> set[str]:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "dynamod-pods"]
    added = {r["target_label"] for r in job["relabel_configs"] if not r.get("target_label", "__").startswith("__")}
    return added | {"job", "instance"}


def test_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    for panel in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"


def test_every_query_names_at_least_one_metric() -> None:
    for where, expr, _ in _queries():
        assert promql.metric_names(expr), f"{where}: no metric found in {expr!r}"


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    series = _exported().series
    missing = {}
    for where, expr, _ in _queries():
        for name in promql.metric_names(expr) - set(PLANNER_METRICS):
            if name not in series:
                missing.setdefault(name, []).append(where)
    assert not missing, "metrics no dynamod collector registers:\n" + "\n".join(
        f"  {name}: {', '.join(places)}" for name, places in sorted(missing.items())
    )


def test_planner_exports_the_replica_series_the_dashboard_plots() -> None:
    """Fails by name until the planner role registers these (daemon/planner/metrics.py)."""
    used = {n for _, expr, _ in _queries() for n in promql.metric_names(expr) if n.startswith("dynamo_planner_")}
    assert used == set(PLANNER_METRICS), f"the dashboard's planner series changed: {sorted(used)}"
    exported = _exported()
    problems = []
    for name, labels in PLANNER_METRICS.items():
        if name not in exported.series:
            problems.append(f"{name}{{{', '.join(sorted(labels))}}} is not exported: the planner must register this gauge")
        elif not labels <= exported.labels[exported.series[name]]:
            problems.append(f"{name} lacks labels {sorted(labels - exported.labels[exported.series[name]])}")
    assert not problems, "\n".join(problems)


def test_every_label_the_dashboard_uses_exists() -> None:
    exported = _exported()
    scrape_labels = _target_labels()
    problems = []
    for where, expr, legend in _queries():
        families = [exported.series[n] for n in promql.metric_names(expr) if n in exported.series]
        known = set(scrape_labels)
        for family in families:
            known |= exported.labels[family]
        if any(n.endswith("_bucket") for n in promql.metric_names(expr)):
            known.add("le")
        for label in (promql.label_names(expr) | promql.legend_labels(legend)) - known:
            problems.append(f"{where}: label {label!r} is on none of {sorted(set(families))} nor added by the scrape config")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("what", sorted(REQUIRED))
def test_dashboard_shows(what: str) -> None:
    used = {n for _, expr, _ in _queries() for n in promql.metric_names(expr)}
    assert REQUIRED[what] in used


def test_promql_reader() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, model) (rate(dynamo_frontend_time_to_first_token_seconds_bucket'
            '{namespace=~"$namespace", model!="x"}[$__rate_interval]))) / on (pod) group_left up')
    assert promql.metric_names(expr) == {"dynamo_frontend_time_to_first_token_seconds_bucket", "up"}
    assert promql.label_names(expr) == {"le", "model", "namespace", "pod"}
    assert promql.legend_labels("{{pool}} desired {{ component }}") == {"pool", "component"}
    assert promql.label_values_query('label_values(m{a="b"}, model)') == ('m{a="b"}', "model")
