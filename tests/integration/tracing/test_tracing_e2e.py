"""Request traces end to end on a disaggregated cluster of real processes (a frontend, a prefill and
a decode mocker worker; file discovery, TCP request plane, KV blocks moved by the transfer agents),
exporting over OTLP gRPC to an in-process receiver.

What an operator relies on: a request sent with ``x-request-id`` comes back with it; the frontend
(``GET /v1/traces``) and both workers (the ``traces`` control endpoint) hold spans of that request
in one trace, each worker's span parented on the frontend span that called it, the engine's queue,
compute and KV-transfer spans under the worker's, with timings consistent with the response; and
the OTLP collector received the very same spans.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol import control
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.integration.disagg.disagg_support import DisaggCluster
from tests.unit.observability.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.timeout(120)

PROMPT = " ".join(f"In the beginning word {i} was spoken unto the land." for i in range(60))  # ~700 tokens
REQUEST_ID = "trace-e2e-0001"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[DisaggCluster]:
    c = DisaggCluster(tmp_path_factory.mktemp("trace-cluster"), speedup=10.0)
    c.env.update({
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "DYN_TRACE_SAMPLE_RATE": "1.0",
    })
    try:
        c.start_role_worker("prefill")
        c.start_role_worker("decode")
        c.start_frontend("--router-mode", "kv")
        c.wait_pools(prefill=1, decode=1)
        yield c
    finally:
        c.stop()


async def _worker_spans(cluster: DisaggCluster, component: str, worker_hex: str) -> list[dict]:
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(cluster.file_kv), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        client = await rt.namespace().component(component).endpoint(control.TRACES).client()
        await client.wait_for_instances(1, 10, routable=False)
        body = control.encode_body(control.TracesRequest(request_id=REQUEST_ID))
        [reply] = await client.call(body, instance_id=int(worker_hex, 16))
    finally:
        await rt.shutdown(grace_s=0.5)
    assert reply["status"] == "ok", reply
    return reply["spans"]


def _instances(cluster: DisaggCluster) -> dict[str, tuple[str, str]]:
    """Role -> (component, instance hex) of the workers' generate endpoints."""
    out = {}
    for inst in cluster.health()["instances"]:
        if inst["endpoint"] == "generate":
            role = "prefill" if inst["component"] == "prefill" else "decode"
            out[role] = (inst["component"], inst["instance_id"])
    return out


async def test_one_trace_across_frontend_prefill_and_decode(cluster: DisaggCluster, receiver: OtlpReceiver) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        sent = time.time_ns()
        resp = await http.post(
            "/v1/chat/completions", headers={"x-request-id": REQUEST_ID, "x-dynamo-route-explain": "1"},
            json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "ignore_eos": True},
        )
        received = time.time_ns()
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == REQUEST_ID
        assert resp.json()["usage"]["completion_tokens"] == 8
        front = (await http.get("/v1/traces", params={"request_id": REQUEST_ID})).json()["data"]
        slowest = (await http.get("/v1/traces", params={"slowest": "5"})).json()["requests"]

    by_name = {s["name"]: s for s in front}
    root = by_name["http-request"]
    assert root["parent_id"] is None and root["status"] == "ok"
    assert sent <= root["start_unix_ns"] <= root["end_unix_ns"] <= received
    trace_id = root["trace_id"]
    assert all(s["trace_id"] == trace_id and s["component"] == "frontend" for s in front)
    prefill_call, decode_call = by_name["prefill"], by_name["client_request"]
    assert prefill_call["attributes"]["remote"] is True
    assert prefill_call["parent_id"] == decode_call["parent_id"] == root["span_id"]
    route_stages = {s["attributes"]["stage"] for s in front if s["name"] == "route"}
    assert route_stages == {"prefill", "decode"}
    decode_route = next(s for s in front if s["name"] == "route" and s["attributes"]["stage"] == "decode")
    assert "router.overlap_blocks" in decode_route["attributes"] and "router.candidates" in decode_route["attributes"]

    roles = _instances(cluster)
    assert set(roles) == {"prefill", "decode"}
    row = next(r for r in slowest if r["request_id"] == REQUEST_ID)
    assert row["trace_id"] == trace_id and not row["migrated"]
    assert set(row["worker_ids"]) == {roles["prefill"][1], roles["decode"][1]}

    async def spans_of(role: str) -> list[dict] | None:
        spans = await _worker_spans(cluster, *roles[role])
        names = {s["name"] for s in spans}
        return spans if {"handle_payload", "engine.queue", "engine.prefill", "engine.decode"} <= names else None

    prefill_spans = await spans_of("prefill")
    for _ in range(50):  # the prefill stream is drained after the decode started: its end may trail
        if prefill_spans is not None:
            break
        prefill_spans = await spans_of("prefill")
    decode_spans = await spans_of("decode")
    assert prefill_spans is not None and decode_spans is not None

    for role, spans, caller in (("prefill", prefill_spans, prefill_call), ("decode", decode_spans, decode_call)):
        payload = next(s for s in spans if s["name"] == "handle_payload")
        assert payload["trace_id"] == trace_id and payload["parent_id"] == caller["span_id"], role
        assert payload["component"] == role and payload["instance_id"] == roles[role][1]
        attrs = payload["attributes"]
        assert attrs["request_id"] == REQUEST_ID and attrs["model"] == "tiny"
        assert attrs["worker_id"] == roles[role][1] and attrs["role"] == role
        # Engine spans hang under the worker's span, inside it in time.
        for span in spans:
            assert span["trace_id"] == trace_id
            if span["name"] != "handle_payload":
                assert span["parent_id"] == payload["span_id"], (role, span["name"])
                assert payload["start_unix_ns"] <= span["start_unix_ns"] <= span["end_unix_ns"] <= payload["end_unix_ns"] + 1
        # The worker served inside the frontend's call (one host: one clock).
        assert caller["start_unix_ns"] <= payload["start_unix_ns"] <= root["end_unix_ns"]
    decode_payload = next(s for s in decode_spans if s["name"] == "handle_payload")
    assert decode_payload["attributes"]["remote_prefill"] is True
    assert decode_payload["attributes"]["completion_tokens"] == 8
    assert decode_payload["end_unix_ns"] <= root["end_unix_ns"]
    transfer = [s for s in decode_spans if s["name"] == "kv_transfer"]
    assert len(transfer) == 1 and transfer[0]["attributes"]["ok"] is True and transfer[0]["attributes"]["bytes"] > 0

    # The collector got the same spans, from the three processes.
    everything = {s["span_id"]: s for s in (*front, *prefill_spans, *decode_spans)}

    def all_exported(got: list) -> bool:
        return set(everything) <= {s.span_id for s in got}

    got = {s.span_id: s for s in receiver.wait_for(all_exported, timeout=15)}
    for span_id, mine in everything.items():
        theirs = got[span_id]
        assert (theirs.trace_id, theirs.parent_id, theirs.name) == (mine["trace_id"], mine["parent_id"], mine["name"])
        assert theirs.service == f"dynamod-{mine['component']}"
