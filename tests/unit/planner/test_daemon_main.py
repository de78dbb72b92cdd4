"""The planner daemon's wiring: its flags, the observation it builds when a source fails, and the
decision ids a restarted planner continues from."""

from __future__ import annotations

import argparse

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.planner.config import daemon_config_from_args
from dynamod.daemon.planner.main import Observer, add_args, next_decision_id
from dynamod.daemon.planner.metrics import PlannerMetrics
from dynamod.daemon.planner.policy import PoolObservation, TrafficSample
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import ConfigError, UnavailableError
from dynamod.shared.protocol.keys import planner_desired_key, planner_scaled_key
from dynamod.shared.protocol.planner import DesiredReplicas, ScaledReplicas


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_args(parser)
    return parser.parse_args(list(argv))


def test_traffic_source_auto_prefers_prometheus_when_given() -> None:
    assert daemon_config_from_args(parse()).traffic_source == "frontend"
    config = daemon_config_from_args(parse("--prometheus-url", "http://prom:9090", "--dry-run"))
    assert (config.traffic_source, config.dry_run) == ("prometheus", True)
    with pytest.raises(ConfigError, match="--prometheus-url"):
        daemon_config_from_args(parse("--traffic-source", "prometheus"))
    with pytest.raises(ConfigError, match="must differ"):
        daemon_config_from_args(parse("--prefill-component", "backend"))


def test_metrics_urls_from_flags_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_PLANNER_METRICS_URLS", "http://a/metrics, http://b/metrics")
    assert daemon_config_from_args(parse()).metrics_urls == ("http://a/metrics", "http://b/metrics")
    assert daemon_config_from_args(parse("--metrics-url", "http://c/metrics")).metrics_urls == ("http://c/metrics",)


class FakeLoad:
    def pools(self) -> dict[str, PoolObservation]:
        return {"agg": PoolObservation(pool="agg", ready=2)}


class FailingTraffic:
    name = "frontend"

    def __init__(self) -> None:
        self.fail = True

    async def sample(self) -> TrafficSample | None:
        if self.fail:
            raise UnavailableError("no frontend /metrics page could be read")
        return TrafficSample(duration_s=1.0, num_requests=4, isl=10, osl=5, ttft_ms=20, itl_ms=2)


async def test_a_failing_traffic_source_leaves_traffic_unknown_and_is_counted() -> None:
    registry = CollectorRegistry()
    traffic = FailingTraffic()
    observe = Observer(FakeLoad(), traffic, PlannerMetrics(registry))  # type: ignore[arg-type]
    obs = await observe()
    assert obs.traffic is None and obs.pools["agg"].ready == 2
    assert registry.get_sample_value("dynamo_planner_source_errors_total", {"source": "frontend"}) == 1
    traffic.fail = False
    assert (await observe()).traffic is not None


async def test_decision_ids_continue_after_what_an_orchestrator_saw() -> None:
    store = MemStore()
    await store.start()
    try:
        assert await next_decision_id(store, "ns") == 1
        await store.put(planner_desired_key("ns"), msgspec.json.encode(DesiredReplicas(replicas={"agg": 2}, decision_id=41)))
        await store.put(planner_scaled_key("ns"), msgspec.json.encode(ScaledReplicas(replicas={"agg": 2}, decision_id=40)))
        assert await next_decision_id(store, "ns") == 42
        await store.put(planner_scaled_key("ns"), b"garbage")
        assert await next_decision_id(store, "ns") == 42
    finally:
        await store.close()
