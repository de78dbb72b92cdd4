"""An image request's trace reaches the encode worker (real processes: a frontend, an agg mocker
worker serving ``tiny-vl``, one ``dynamod --role encode``): the encode worker's span is a child of
the frontend's ``encode`` span, carries the client's ``x-request-id``, and the encode worker
serves it on its ``traces`` control endpoint like every worker role."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol import control
from dynamod.shared.protocol.encode import ENCODER_COMPONENT
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import wait_until
from tests.integration.encode.test_encode_pool import encoders_ready, start_encoder
from tests.integration.frontend.test_frontend_multimodal import BLOCK, MODEL, image_messages, png_url
from tests.integration.frontend.test_frontend_support import LocalCluster

pytestmark = pytest.mark.timeout(90)

REQUEST_ID = "trace-encode-1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("trace-encode"), speedup=50.0)
    try:
        c.start_worker("--model", MODEL, "--block-size", str(BLOCK), "--kv-transfer-backend", "tcp")
        start_encoder(c, "encoder")
        c.start_frontend()
        c.wait_ready(1, model=MODEL)
        wait_until(lambda: encoders_ready(c, 1), 30, what="a ready encode worker")
        yield c
    finally:
        c.stop()


async def test_encode_span_joins_the_request_trace(cluster: LocalCluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        resp = await http.post("/v1/chat/completions", headers={"x-request-id": REQUEST_ID}, json={
            "model": MODEL, "messages": image_messages(png_url(5)), "max_tokens": 3, "ignore_eos": True,
        })
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == REQUEST_ID
        front = (await http.get("/v1/traces", params={"request_id": REQUEST_ID})).json()["data"]
    caller = next(s for s in front if s["name"] == "encode")
    assert caller["attributes"]["images_remote"] == 1
    encoder = next(i for i in cluster.health()["instances"] if i["component"] == ENCODER_COMPONENT)
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(cluster.file_kv), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        client = await rt.namespace().component(ENCODER_COMPONENT).endpoint(control.TRACES).client()
        await client.wait_for_instances(1, 10, routable=False)
        body = control.encode_body(control.TracesRequest(request_id=REQUEST_ID))
        [reply] = await client.call(body, instance_id=int(encoder["instance_id"], 16))
    finally:
        await rt.shutdown(grace_s=0.5)
    [span] = reply["spans"]
    assert span["component"] == "encode" and span["name"] == "handle_payload"
    assert span["trace_id"] == caller["trace_id"] and span["parent_id"] == caller["span_id"]
    assert span["attributes"]["request_id"] == REQUEST_ID and span["attributes"]["images"] == 1
    assert caller["start_unix_ns"] <= span["start_unix_ns"] <= span["end_unix_ns"] <= caller["end_unix_ns"]
