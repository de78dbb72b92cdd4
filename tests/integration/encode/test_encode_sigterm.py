"""SIGTERM to an encode worker while it encodes: the image in flight is still encoded there and
read by the agg worker (the request completes on the remote path, nothing falls back), then the
worker's records leave discovery and the process exits 0."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.encode.test_encode_pool import (
    chat,
    encoders_ready,
    metric,
    start_encoder,
    status_metrics,
)
from tests.integration.frontend.test_frontend_multimodal import (
    BLOCK,
    IMAGE_TOKENS,
    MODEL,
    image_messages,
    png_url,
)
from tests.integration.frontend.test_frontend_support import LocalCluster, get_text

pytestmark = pytest.mark.timeout(60)


def test_sigterm_finishes_the_encode_in_flight_then_deregisters(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, speedup=50.0) as c:
        c.start_worker("--model", MODEL, "--block-size", str(BLOCK), "--kv-transfer-backend", "tcp")
        # 1.3 s an image: time to signal it while it encodes; a grace long enough to finish.
        enc, port = start_encoder(c, "encoder", "--encode-ms-per-image-token", "20", "--shutdown-grace", "10")
        c.start_frontend("--router-mode", "kv")
        c.wait_ready(1, model=MODEL)
        wait_until(lambda: encoders_ready(c, 1), 30, what="a ready encode worker")
        api = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=30)
        results: list[object] = []
        errors: list[BaseException] = []

        def send() -> None:
            try:
                results.append(chat(api, image_messages(png_url(51))))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        wait_until(lambda: metric(status_metrics(port), "dynamo_component_encoder_inflight_images") >= 1, 10,
                   what="the image on the encoder")
        enc.popen.send_signal(signal.SIGTERM)
        thread.join(30)
        assert not errors, errors
        assert len(results) == 1 and results[0].usage.prompt_tokens > IMAGE_TOKENS
        front = get_text(c.url + "/metrics")
        assert metric(front, "dynamo_frontend_encode_images_total", path="remote") == 1, front
        assert metric(front, "dynamo_frontend_encode_failures_total") == 0
        work = status_metrics(c.worker_status_ports[c.workers[0].name])
        assert metric(work, "dynamo_component_embedding_cache_misses_total") == 1  # read from the encoder...
        assert metric(work, "dynamo_component_embedding_transfer_failures_total") == 0  # ...while it still served reads
        assert enc.popen.wait(15) == 0
        assert "encode worker stopped" in enc.log()  # the whole stop ran: drained, deregistered, closed
        # Deregistered, not left to its lease (c.lease_ttl): the records go within a watch's delay.
        wait_until(lambda: not [i for i in c.health().get("instances", []) if i.get("component") == "encoder"],
                   min(2.0, c.lease_ttl / 2), what="the encoder's records gone")
