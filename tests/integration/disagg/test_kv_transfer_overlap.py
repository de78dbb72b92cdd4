"""KV transfer overlapped with the prefill, end to end with real processes (``--kv-transfer-overlap
chunk``, the default): the prefill worker sends streaming transfer parameters when it admits the
prompt, the frontend dispatches the decode at once, the decode worker reads each chunk's blocks as
they are computed and starts when the last lands; a prefill worker killed after its early
parameters costs the request nothing: the decode worker's read fails and it prefills locally.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.disagg.disagg_support import DisaggCluster, explain, metric_sum

pytestmark = pytest.mark.timeout(120)

FRESH_PROMPT = [(7 * i) % 4000 + 50 for i in range(2000)]  # ~8 chunks of 256 tokens on the prefill worker


def _api(cluster: DisaggCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _cluster(tmp_path, backend: str, *prefill_flags: str) -> DisaggCluster:
    c = DisaggCluster(tmp_path, speedup=10.0)
    try:
        c.start_role_worker("prefill", "--max-num-batched-tokens", "256", "--kv-transfer-backend", backend, *prefill_flags)
        c.start_role_worker("decode", "--kv-transfer-backend", backend, "--kv-transfer-timeout", "3")
        c.start_frontend("--router-mode", "kv")
        c.wait_pools(prefill=1, decode=1)
    except BaseException:
        c.stop()
        raise
    return c


async def test_streamed_transfer_delivers_the_prefilled_blocks(tmp_path) -> None:
    # auto: NIXL where installed (readiness long-polled over the block server, bytes by NIXL READ).
    c = _cluster(tmp_path, "auto")
    try:
        async with _api(c) as api:
            raw = await api.completions.with_raw_response.create(
                model="tiny", prompt=FRESH_PROMPT, max_tokens=8, extra_body={"ignore_eos": True},
                extra_headers={"x-dynamo-route-explain": "1"},
            )
            assert raw.parse().usage.completion_tokens == 8
            disagg = explain(raw.headers)["disagg"]
            assert disagg["mode"] == "remote", disagg
            # What the decode worker's read measured, in the route explanation.
            transfer = disagg["transfer"]
            assert transfer["ok"] and transfer["streamed"] and transfer["blocks"] == 32, transfer
            assert 0 <= transfer["exposed_ms"] < 5000 and len(transfer["from_worker_id"]) == 16, transfer
        prefill, decode = c.by_role("prefill")[0], c.by_role("decode")[0]

        def settled() -> str | None:
            text = c.metrics(decode)
            return text if metric_sum(text, "dynamo_component_kv_transfer_exposed_seconds_count", overlap="streamed") else None

        decode_metrics = wait_until(settled, 10, what="the decode worker's streamed transfer")
        assert metric_sum(decode_metrics, "dynamo_component_kv_transfer_failures_total") == 0
        # Every block of the prompt moved (tiny's 64-token blocks), checksum verified with the last one.
        assert metric_sum(decode_metrics, "dynamo_component_kv_transfer_blocks_total", direction="pulled") == 32
        wait_until(lambda: metric_sum(c.metrics(prefill), "dynamo_component_kv_held_blocks") == 0, 10,
                   what="the prefill worker released its blocks")
        prefill_metrics = c.metrics(prefill)
        assert metric_sum(prefill_metrics, "dynamo_component_kv_transfer_blocks_total", direction="served") == 32
        served = metric_sum(prefill_metrics, "dynamo_component_kv_transfer_bytes_total", direction="served")
        assert served == metric_sum(decode_metrics, "dynamo_component_kv_transfer_bytes_total", direction="pulled") > 0
    finally:
        c.stop()


async def test_prefill_worker_killed_after_its_early_params_the_decode_prefills_locally(tmp_path) -> None:
    # A slow prefill (0.05x: ~8 steps of ~0.4 s) leaves time to kill it once its params are out.
    c = _cluster(tmp_path, "tcp", "--speedup-ratio", "0.05")
    try:
        async with _api(c) as api:
            request = asyncio.create_task(api.completions.create(
                model="tiny", prompt=FRESH_PROMPT, max_tokens=8, extra_body={"ignore_eos": True},
            ))
            # The frontend got the streaming params (the prefill stage ended) and sent the decode.
            await asyncio.to_thread(
                wait_until,
                lambda: metric_sum(c.frontend_metrics(), "dynamo_frontend_prefill_duration_seconds_count") >= 1,
                15, interval=0.02, what="the early transfer parameters",
            )
            assert not request.done()
            victim = c.by_role("prefill")[0]
            victim.kill9()
            done = await asyncio.wait_for(request, 30)
        assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
        decode = c.by_role("decode")[0]
        failures = metric_sum(c.metrics(decode), "dynamo_component_kv_transfer_failures_total", reason="peer_lost")
        assert failures == 1  # the read broke off; the request was prefilled on the decode worker
    finally:
        c.stop()
