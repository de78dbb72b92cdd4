"""The planner daemon's observation sources: the pools from discovery and the event plane, the
traffic from the frontends' /metrics pages (differenced) or from a Prometheus server.

The HTTP edge is an ``httpx.MockTransport`` serving what a frontend or Prometheus would answer;
discovery is the in-memory store and the load reports travel over the real ZMQ event plane.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from dynamod.daemon.planner.load_watch import UNLISTED_REPORT_TTL_S, LoadWatch
from dynamod.daemon.planner.prometheus import PrometheusTraffic, traffic_queries
from dynamod.daemon.planner.traffic import FrontendScrape, FrontendTotals, parse_totals
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import UnavailableError
from dynamod.shared.events.plane import TOPIC_KV_METRICS
from dynamod.shared.protocol.instance import Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key
from dynamod.shared.protocol.load import LoadMetrics, load_encoder
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.unit.planner.test_loop import wait_for

NS = "test"


def page(requests: float, ttft: tuple[float, float], itl: tuple[float, float], isl: tuple[float, float],
         osl: tuple[float, float], model: str = "tiny", inflight: float = 0) -> str:
    """A frontend /metrics page with cumulative (sum, count) per histogram."""
    lines = ["# TYPE dynamo_frontend_requests counter",
             f'dynamo_frontend_requests_total{{model="{model}",endpoint="chat_completions",request_type="stream",status="success"}} {requests}',
             'dynamo_frontend_requests_total{model="other",endpoint="chat_completions",request_type="stream",status="success"} 1000',
             "# TYPE dynamo_frontend_inflight_requests gauge",
             f'dynamo_frontend_inflight_requests{{model="{model}"}} {inflight}',
             'dynamo_frontend_inflight_requests{model="other"} 7']
    for name, (total, count) in (("time_to_first_token_seconds", ttft), ("inter_token_latency_seconds", itl),
                                 ("input_sequence_tokens", isl), ("output_sequence_tokens", osl)):
        lines += [f"# TYPE dynamo_frontend_{name} histogram",
                  f'dynamo_frontend_{name}_bucket{{model="{model}",le="+Inf"}} {count}',
                  f'dynamo_frontend_{name}_sum{{model="{model}"}} {total}',
                  f'dynamo_frontend_{name}_count{{model="{model}"}} {count}']
    return "\n".join(lines) + "\n"


def test_parse_totals_filters_the_model_case_insensitively() -> None:
    text = page(10, (1.0, 10), (0.5, 100), (1000, 10), (200, 10))
    assert parse_totals(text, "TINY") == FrontendTotals(10, 1.0, 10, 0.5, 100, 1000, 10, 200, 10,
                                                        ttft_le={float("inf"): 10}, itl_le={float("inf"): 100},
                                                        osl_le={float("inf"): 10})
    assert parse_totals(text).requests == 1010
    assert parse_totals(page(1, (0, 0), (0, 0), (0, 0), (0, 0), inflight=3), "tiny").inflight == 3


async def test_frontend_scrape_counts_arrivals_not_only_finished_requests() -> None:
    """A saturated cluster finishes what it can serve; the requests piling up in flight are
    demand too, and requests draining from flight are not new ones."""
    bodies = [page(100, (0, 0), (0, 0), (0, 0), (0, 0), inflight=4),
              page(110, (0, 0), (0, 0), (0, 0), (0, 0), inflight=34),   # +10 finished, +30 queued
              page(150, (0, 0), (0, 0), (0, 0), (0, 0), inflight=4),    # +40 finished, 30 of them old
              page(150, (0, 0), (0, 0), (0, 0), (0, 0), inflight=0),    # only draining: none came
              page(2, (0, 0), (0, 0), (0, 0), (0, 0), inflight=5)]      # restarted: from zero

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=bodies.pop(0))

    source = FrontendScrape(None, NS, urls=["http://a/metrics"], model="tiny",
                            client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    try:
        await source.start()
        counts = [(await source.sample()).num_requests for _ in range(4)]  # type: ignore[union-attr]
    finally:
        await source.close()
    assert counts == [40, 10, 0, 7]


async def test_frontend_scrape_differences_each_page_and_restarts_from_zero() -> None:
    pages = {
        "http://a/metrics": [page(10, (1, 10), (1, 100), (1000, 10), (100, 10)),
                             page(30, (5, 30), (3, 300), (5000, 30), (500, 30)),
                             page(5, (1, 5), (0.5, 50), (500, 5), (50, 5))],  # restarted
        "http://b/metrics": [page(0, (0, 0), (0, 0), (0, 0), (0, 0)),
                             page(20, (2, 20), (2, 200), (2000, 20), (200, 20)),
                             RuntimeError("gone")],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        body = pages[str(request.url)].pop(0)
        if isinstance(body, Exception):
            return httpx.Response(503)
        return httpx.Response(200, text=body)

    source = FrontendScrape(None, NS, urls=list(pages), model="tiny", client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    try:
        await source.start()  # baseline
        first = await source.sample()
        second = await source.sample()
    finally:
        await source.close()
    assert first is not None and first.duration_s > 0
    # a: +20 requests, ttft +4 s over +20, isl +4000/+20; b: +20, ttft +2 s over +20.
    assert first.num_requests == 40
    assert first.ttft_ms == pytest.approx(6 / 40 * 1000)
    assert first.itl_ms == pytest.approx(4 / 400 * 1000)
    assert first.isl == pytest.approx(6000 / 40) and first.osl == pytest.approx(600 / 40)
    # a restarted (counts from zero), b failed (no contribution).
    assert second is not None and second.num_requests == 5 and second.ttft_ms == pytest.approx(200.0)


async def test_frontend_scrape_without_traffic_reports_unknown_latency_and_all_down_raises() -> None:
    bodies = [page(3, (1, 3), (1, 10), (30, 3), (30, 3))] * 2

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=bodies.pop(0)) if bodies else httpx.Response(500)

    source = FrontendScrape(None, NS, urls=["http://a/metrics"], client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    try:
        await source.start()
        idle = await source.sample()
        assert idle is not None and idle.num_requests == 0 and idle.ttft_ms is None and idle.isl is None
        with pytest.raises(UnavailableError):
            await source.sample()
    finally:
        await source.close()


def test_prometheus_queries_follow_dynamo() -> None:
    q = traffic_queries(4.2, model="tiny", extra_selector='namespace="prod"')
    assert q["num_requests"] == (
        'sum(increase(dynamo_frontend_requests_total{model="tiny",namespace="prod"}[5s])) + '
        '(sum(delta(dynamo_frontend_inflight_requests{model="tiny",namespace="prod"}[5s])) or vector(0))')
    assert q["ttft_s"] == ('sum(increase(dynamo_frontend_time_to_first_token_seconds_sum{model="tiny",namespace="prod"}[5s])) / '
                           'sum(increase(dynamo_frontend_time_to_first_token_seconds_count{model="tiny",namespace="prod"}[5s]))')


async def test_prometheus_traffic_reads_the_http_api_and_no_data_is_unknown() -> None:
    answers = {"requests_total": "120", "time_to_first_token": "0.25", "inter_token": "NaN",
               "input_sequence": "3000", "output_sequence": "150"}
    empty = False

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query"
        query = request.url.params["query"]
        if empty:
            return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": []}})
        value = next(v for k, v in answers.items() if k in query)
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]}})

    source = PrometheusTraffic("http://prom:9090/", 60, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    try:
        sample = await source.sample()
        empty = True
        unknown = await source.sample()
    finally:
        await source.close()
    assert sample is not None
    assert (sample.duration_s, sample.num_requests, sample.ttft_ms, sample.itl_ms, sample.isl, sample.osl) == (60, 120, 250.0, None, 3000, 150)
    assert unknown is None


async def test_prometheus_unreachable_raises_unavailable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    source = PrometheusTraffic("http://prom:9090", 60, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    try:
        with pytest.raises(UnavailableError):
            await source.sample()
    finally:
        await source.close()


# -- the pools --------------------------------------------------------------------------------


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    store = MemStore()
    rt = await DistributedRuntime.create(RuntimeSettings(namespace=NS, discovery_backend="mem", event_plane="zmq"), store=store)
    yield rt
    await rt.shutdown(grace_s=0)


async def put_worker(store: MemStore, component: str, iid: int, role: str, status: str = "ready") -> str:
    key = instance_key(NS, component, "generate", iid)
    await store.put(key, encode_instance(Instance(namespace=NS, component=component, endpoint="generate", instance_id=iid,
                                                   transport="tcp", address="127.0.0.1:1", role=role, status=status)))
    return key


async def test_pools_count_ready_workers_by_role_and_keep_their_last_load(runtime: DistributedRuntime) -> None:
    store = runtime.store
    assert isinstance(store, MemStore)
    await put_worker(store, "prefill", 1, "prefill")
    await put_worker(store, "backend", 2, "decode")
    gone = await put_worker(store, "backend", 3, "decode")
    await put_worker(store, "backend", 4, "decode", status="draining")
    await put_worker(store, "backend", 5, "agg")
    watch = LoadWatch(runtime)
    await watch.start()
    try:
        publisher = await runtime.namespace().component("backend").publisher(TOPIC_KV_METRICS)
        # ZMQ subscribers connect asynchronously: publish until the reports arrive.
        reports = [LoadMetrics(worker_id=w, kv_usage=0.1 * w, total_blocks=100, num_waiting=w) for w in (2, 3, 4)]

        async def delivered() -> None:
            while len(watch.pools()["decode"].loads) < 2:
                for r in reports:
                    await publisher.publish(TOPIC_KV_METRICS, load_encoder.encode(r))
                await asyncio.sleep(0.02)

        await asyncio.wait_for(delivered(), 10)
        pools = watch.pools()
        assert {p: o.ready for p, o in pools.items()} == {"prefill": 1, "decode": 2, "agg": 1}
        assert [w.worker_id for w in pools["decode"].loads] == [2, 3]  # the draining worker's load is not capacity
        assert pools["decode"].loads[0].kv_usage == pytest.approx(0.2)
        assert pools["decode"].draining == 1  # still paid for: the GPU budget counts it
        # how long each worker has been ready, for the policies' cold-start rule
        later = watch.pools(now=time.monotonic() + 60.0)
        assert all(w.ready_for_s is not None and w.ready_for_s >= 59.0 for w in later["decode"].loads)

        # A worker that leaves discovery takes its report with it.
        await store.delete(gone)

        await wait_for(lambda: watch.pools()["decode"].ready == 1)
        assert (3, 0) not in watch._reports
        # A report for a worker discovery never lists is forgotten after a while.
        watch.observe(LoadMetrics(worker_id=99), now=0.0)
        watch.pools(now=time.monotonic())
        assert (99, 0) not in watch._reports
        watch.observe(LoadMetrics(worker_id=98))
        watch.pools(now=time.monotonic() + UNLISTED_REPORT_TTL_S / 2)
        assert (98, 0) in watch._reports
    finally:
        await watch.close()
