"""How one fleet member's ``/metrics`` combines its peers' series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamod.daemon.frontend.http.fleet_metrics import merge_expositions, render, wants_process_scope


def _member(requests: int, inflight: int, hit_rate: float, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    Counter("dynamo_frontend_requests", "r", ("model",), registry=registry).labels("tiny").inc(requests)
    Gauge("dynamo_frontend_inflight_requests", "i", registry=registry).set(inflight)
    Gauge("dynamo_frontend_kv_hit_rate", "h", registry=registry).set(hit_rate)
    hist = Histogram("dynamo_frontend_request_duration_seconds", "d", buckets=(0.1, 1.0), registry=registry)
    for value in latencies:
        hist.observe(value)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_histograms_and_gauges_add_ratios_average_start_times_take_the_earliest() -> None:
    a = _member(3, 2, 0.5, [0.05, 0.5])
    b = _member(4, 1, 0.25, [2.0])
    merged = _samples(render(merge_expositions([a, b])).decode())
    assert merged[("dynamo_frontend_requests_total", (("model", "tiny"),))] == 7
    assert merged[("dynamo_frontend_inflight_requests", ())] == 3
    assert merged[("dynamo_frontend_kv_hit_rate", ())] == 0.375
    assert merged[("dynamo_frontend_request_duration_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("dynamo_frontend_request_duration_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("dynamo_frontend_request_duration_seconds_bucket", (("le", "+Inf"),))] == 3
    assert merged[("dynamo_frontend_request_duration_seconds_count", ())] == 3
    created_a = _samples(a)[("dynamo_frontend_requests_created", (("model", "tiny"),))]
    created_b = _samples(b)[("dynamo_frontend_requests_created", (("model", "tiny"),))]
    assert merged[("dynamo_frontend_requests_created", (("model", "tiny"),))] == min(created_a, created_b)


def test_one_member_is_itself() -> None:
    a = _member(3, 2, 0.5, [0.05])
    assert _samples(render(merge_expositions([a])).decode()) == _samples(a)


def test_process_scope_query() -> None:
    assert wants_process_scope({"query_string": b"scope=process"})
    assert wants_process_scope({"query_string": b"x=1&scope=process"})
    assert not wants_process_scope({"query_string": b""})
    assert not wants_process_scope({"query_string": b"scope=fleet"})
