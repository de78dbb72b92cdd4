"""Histogram quantiles and frontend /metrics parsing: the numbers behind the Models view."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dynamod.console.state import histogram
from dynamod.console.state.prom import parse_frontend_metrics


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 10.0, 0.2: 30.0, 0.5: 40.0, math.inf: 40.0}
    assert histogram.quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert histogram.quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram.quantile(0.05, buckets) == pytest.approx(0.02)  # rank 2 of 10 in (0, 0.1]: from 0
    assert histogram.quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * (39.6 - 30) / 10)


def test_quantile_in_inf_bucket_returns_highest_finite_bound() -> None:
    assert histogram.quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == 0.1


def test_quantile_of_empty_histogram_is_none() -> None:
    assert histogram.quantile(0.5, {}) is None
    assert histogram.quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None


def test_subtract_gives_the_window_and_survives_a_reset() -> None:
    newer = {0.1: 15.0, math.inf: 20.0}
    assert histogram.subtract(newer, {0.1: 10.0, math.inf: 12.0}) == {0.1: 5.0, math.inf: 8.0}
    assert histogram.subtract({0.1: 1.0, math.inf: 2.0}, {0.1: 10.0, math.inf: 12.0}) == {0.1: 1.0, math.inf: 2.0}


def test_parse_real_prometheus_client_output() -> None:
    """Parses what prometheus-client (and so our frontend) actually writes."""
    reg = CollectorRegistry()
    req = Counter("dynamo_frontend_requests", "r", ("model", "endpoint", "request_type", "status"), registry=reg)
    ttft = Histogram("dynamo_frontend_time_to_first_token_seconds", "t", ("model",), buckets=(0.05, 0.1, 0.5), registry=reg)
    mig = Counter("dynamo_frontend_model_migration", "m", ("model", "migration_type"), registry=reg)
    last = Gauge("dynamo_frontend_worker_last_inter_token_latency_seconds", "i", ("worker_id",), registry=reg)
    inflight = Gauge("dynamo_frontend_inflight_requests", "f", ("model",), registry=reg)
    Counter("dynamo_frontend_prompt_tokens", "p", ("model",), registry=reg).labels("m1").inc(100)
    Counter("dynamo_frontend_cached_tokens", "c", ("model",), registry=reg).labels("m1").inc(40)
    req.labels("m1", "chat_completions", "stream", "success").inc(8)
    req.labels("m1", "completions", "unary", "error").inc(2)
    req.labels("m1", "completions", "unary", "cancelled").inc(1)
    for v in (0.01, 0.07, 0.07, 0.3):
        ttft.labels("m1").observe(v)
    mig.labels("m1", "ongoing_request").inc(3)
    last.labels("1a2b").set(0.02)
    inflight.labels("m1").set(5)
    scrape = parse_frontend_metrics(generate_latest(reg).decode())
    assert scrape.requests == {"m1": 11.0}
    assert scrape.errors == {"m1": 2.0}  # cancelled is not an error
    assert scrape.ttft["m1"] == {0.05: 1.0, 0.1: 3.0, 0.5: 4.0, math.inf: 4.0}
    assert scrape.migrations == {"m1": 3.0}
    assert scrape.worker_itl == {0x1A2B: 0.02}
    assert scrape.inflight == {"m1": 5.0}
    assert (scrape.prompt_tokens, scrape.cached_tokens) == ({"m1": 100.0}, {"m1": 40.0})


def test_parse_ignores_unknown_families() -> None:
    scrape = parse_frontend_metrics("# TYPE other_metric gauge\nother_metric 3\n")
    assert scrape.models == set()
