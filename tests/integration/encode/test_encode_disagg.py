"""E+P+D end to end: an encode worker, a prefill and a decode mocker worker serving ``tiny-vl``
and a frontend, as real processes, through the official ``openai`` client.

The image is encoded by the encode worker; the *prefill* worker reads its embedding (its cache
counts the read) and prefills; the decode worker reads the KV, not the embedding; the answer has
the same prompt tokens as the aggregated path (the image's 64 tokens and two markers over the text).
The same image again is not encoded: the prefill worker caches its blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.disagg.disagg_support import DisaggCluster, metric_sum
from tests.integration.encode.test_encode_pool import chat, encoders_ready, start_encoder
from tests.integration.frontend.test_frontend_multimodal import (
    BLOCK,
    FOLLOW,
    IMAGE_TOKENS,
    MODEL,
    QUESTION,
    image_messages,
    png_url,
)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DisaggCluster]:
    c = DisaggCluster(tmp_path_factory.mktemp("epd-cluster"), speedup=50.0)
    try:
        flags = ("--model", MODEL, "--block-size", str(BLOCK), "--kv-transfer-backend", "tcp")
        c.start_role_worker("prefill", *flags)
        c.start_role_worker("decode", *flags)
        start_encoder(c, "encoder-1")
        c.start_frontend("--router-mode", "kv")
        c.wait_pools(1, 1, model=MODEL)
        wait_until(lambda: encoders_ready(c, 1), 30, what="a ready encode worker")
        yield c
    finally:
        c.stop()


def test_e_p_d(cluster: DisaggCluster) -> None:
    api = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=30)
    text_only = chat(api, [{"role": "user", "content": QUESTION + FOLLOW}])
    answer = chat(api, image_messages(png_url(31)))
    assert answer.usage.prompt_tokens - text_only.usage.prompt_tokens == IMAGE_TOKENS + 2
    prefill, decode = cluster.by_role("prefill")[0], cluster.by_role("decode")[0]
    assert metric_sum(cluster.metrics(prefill), "dynamo_component_embedding_cache_misses_total") == 1
    assert metric_sum(cluster.metrics(prefill), "dynamo_component_embedding_transfer_failures_total") == 0
    assert metric_sum(cluster.metrics(decode), "dynamo_component_embedding_cache_misses_total") == 0
    assert metric_sum(cluster.frontend_metrics(), "dynamo_frontend_encode_images_total", path="remote") == 1
    # The same image again: the prefill worker caches its blocks (the prefill router's estimate
    # says so), so it is not encoded at all.
    again = chat(api, image_messages(png_url(31)))
    assert again.usage.prompt_tokens == answer.usage.prompt_tokens
    front = cluster.frontend_metrics()
    assert metric_sum(front, "dynamo_frontend_encode_images_total", path="cached") == 1
    assert metric_sum(front, "dynamo_frontend_encode_images_total", path="remote") == 1
