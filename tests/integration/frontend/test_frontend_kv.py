"""``--router-mode kv`` with real mocker workers: a repeated prompt goes where its KV blocks are.

Round-robin would alternate between the two workers; the KV router must keep sending the prompt
to the worker that cached it (learned from the workers' KV events), which then reports the cached
prompt tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster, get_text

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("kv-cluster"))
    try:
        c.start_worker("--block-size", "16")
        c.start_worker("--block-size", "16")
        c.start_frontend("--router-mode", "kv")
        c.wait_ready(2)
        # Both workers' caches re-read once the frontend's event subscriptions have settled
        # (two kv_dump reads per worker): from then on no KV event can be lost to a slow join.
        wait_until(lambda: _resyncs_ok(c) >= 4, 15, what="the frontend's settled kv_dump reads")
        yield c
    finally:
        c.stop()


def _resyncs_ok(c: LocalCluster) -> float:
    text = get_text(c.url + "/metrics")
    return sum(float(v) for v in re.findall(r'dynamo_router_kv_resyncs_total\{outcome="ok"\} ([0-9.]+)', text))


def test_repeated_prompt_follows_its_cache(cluster: LocalCluster) -> None:
    api = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=30)
    prompts = [f"document {i}: " + " ".join(f"word{i}x{j}" for j in range(120)) for i in range(2)]
    for prompt in prompts:
        served = []
        cached = []
        for _ in range(4):
            raw = api.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True}
            )
            served.append(raw.headers["x-dynamo-worker-instance-id"])
            cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        assert len(set(served)) == 1, served
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    metrics = get_text(cluster.url + "/metrics")
    hit_rate = float(re.search(r'dynamo_frontend_kv_hit_rate\{model="tiny"\} ([0-9.e-]+)', metrics).group(1))
    assert 0.5 < hit_rate < 1.0
    stored = re.findall(r'dynamo_router_kv_events_total\{event_type="stored",[^}]*\} ([0-9.]+)', metrics)
    assert sum(float(v) for v in stored) >= len(prompts), "the router saw no KV events"
    assert re.search(r'dynamo_router_decisions_total\{reason="lowest_cost"\} [1-9]', metrics)
