"""Disaggregated serving end to end, with real processes on loopback: a frontend, prefill and
decode mocker workers (file discovery, ZMQ events, TCP request plane, KV blocks moved by the
workers' transfer agents).

What a user relies on: chat and completions, streaming and unary, are served with the prompt
prefilled on the prefill pool; cached tokens are reported; the bytes the decode worker received
are the bytes the prefill worker computed; a prefill or decode worker killed (or frozen) under
load loses no stream; with no prefill worker the decode pool prefills locally; conditional
disaggregation follows its thresholds.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.disagg.disagg_support import DisaggCluster, explain, metric_sum

pytestmark = pytest.mark.timeout(240)

LONG_PROMPT = " ".join(f"In the beginning word {i} was spoken unto the land." for i in range(60))  # ~700 tokens


def _api(cluster: DisaggCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _explain_on() -> dict[str, str]:
    return {"x-dynamo-route-explain": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DisaggCluster]:
    c = DisaggCluster(tmp_path_factory.mktemp("disagg-cluster"), speedup=10.0)
    try:
        c.start_role_worker("prefill")
        c.start_role_worker("decode")
        c.start_frontend("--router-mode", "kv")
        c.wait_pools(prefill=1, decode=1)
        yield c
    finally:
        c.stop()


async def test_chat_and_completions_remote_prefill(cluster: DisaggCluster) -> None:
    async with _api(cluster) as api:
        # Unary chat.
        raw = await api.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=12,
            extra_body={"ignore_eos": True}, extra_headers=_explain_on(),
        )
        chat = raw.parse()
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage.completion_tokens == 12
        route = explain(raw.headers)
        assert route["disagg"]["mode"] == "remote", route
        assert route["stage"] == "decode" and route["prefill"]["stage"] == "prefill", route
        # Streaming chat: every token arrives, and usage at the end.
        pieces, usage = [], None
        stream = await api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG_PROMPT + " again"}], max_tokens=20, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 20 and pieces
        # Unary and streaming completions.
        comp = await api.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
        assert comp.usage.completion_tokens == 8 and comp.choices[0].text
        tokens = 0
        async for chunk in await api.completions.create(
            model="tiny", prompt=LONG_PROMPT + " twice", max_tokens=16, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        ):
            if chunk.choices:
                tokens += len(getattr(chunk.choices[0], "token_ids", None) or [])
        assert tokens == 16


async def test_cached_tokens_reported_and_bytes_match(cluster: DisaggCluster) -> None:
    async with _api(cluster) as api:
        prompt = "Cache me first. " + LONG_PROMPT  # a new first block: nothing of it is cached yet
        first = await api.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
        second = await api.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
        details = second.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens >= 64, second.usage
        assert (first.usage.prompt_tokens_details is None or first.usage.prompt_tokens_details.cached_tokens < details.cached_tokens)
        prefill, decode = cluster.by_role("prefill")[0], cluster.by_role("decode")[0]

        def settled() -> tuple[float, float] | None:
            served = metric_sum(cluster.metrics(prefill), "dynamo_component_kv_transfer_bytes_total", direction="served")
            pulled = metric_sum(cluster.metrics(decode), "dynamo_component_kv_transfer_bytes_total", direction="pulled")
            return (served, pulled) if served > 0 and served == pulled else None

        served, pulled = wait_until(settled, 10, what="decode pulled exactly what prefill served")
        decode_metrics = cluster.metrics(decode)
        # The decode worker verifies every transfer's checksum against the one the prefill worker
        # computed; a mismatch would be counted here (and the request prefilled locally).
        assert metric_sum(decode_metrics, "dynamo_component_kv_transfer_failures_total") == 0
        assert metric_sum(decode_metrics, "dynamo_component_kv_transfer_blocks_total", direction="pulled") > 0
        # Held blocks are released once the decode worker confirms.
        wait_until(lambda: metric_sum(cluster.metrics(prefill), "dynamo_component_kv_held_blocks") == 0, 10,
                   what="prefill worker released its held blocks")
        assert served == pulled


async def _stream_tokens(api: openai.AsyncOpenAI, index: int, max_tokens: int, progress: list[int]) -> tuple[int, str]:
    received, finish = 0, ""
    async for chunk in await api.completions.create(
        # Each prompt new from its first block: nothing cached anywhere pins them to one worker.
        model="tiny", prompt=f"Stream {index} begins. {LONG_PROMPT}", max_tokens=max_tokens, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ):
        if chunk.choices:
            received += len(getattr(chunk.choices[0], "token_ids", None) or [])
            progress[index] = received
            finish = chunk.choices[0].finish_reason or finish
    return received, finish


async def _run_streams(cluster: DisaggCluster, n: int, max_tokens: int, fault, *, gap_s: float = 0.05) -> None:
    """``n`` streams started ``gap_s`` apart, so prefills and transfers are under way at any
    moment; ``fault()`` runs once a quarter of them started. All must end complete (exactly
    ``max_tokens`` tokens, finish ``length``): no stream lost or silently truncated."""
    async with _api(cluster) as api:
        progress = [0] * n
        tasks: list[asyncio.Task[tuple[int, str]]] = []
        for i in range(n):
            tasks.append(asyncio.create_task(_stream_tokens(api, i, max_tokens, progress)))
            if i == n // 4:
                await asyncio.to_thread(fault)
            await asyncio.sleep(gap_s)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        for i, (received, finish) in enumerate(results):
            assert (received, finish) == (max_tokens, "length"), f"stream {i}: {received} tokens, finish {finish!r}"


def _recoveries(cluster: DisaggCluster) -> float:
    """Prefills the frontend gave up on plus transfers the decode workers gave up on."""
    total = metric_sum(cluster.frontend_metrics(), "dynamo_frontend_prefill_failures_total")
    for proc in cluster.by_role("decode"):
        total += metric_sum(cluster.metrics(proc), "dynamo_component_kv_transfer_failures_total")
    return total


@pytest.fixture
def fault_cluster(tmp_path) -> Iterator[DisaggCluster]:
    # A slow mocker keeps requests in flight across the fault; short transfer and prefill deadlines
    # keep a frozen peer's cost to seconds. Our TCP transport here (the module cluster above uses
    # NIXL when it is installed, as `auto` does).
    c = DisaggCluster(tmp_path, speedup=3.0)
    try:
        for _ in range(2):
            c.start_role_worker("prefill", "--kv-hold-timeout", "20", "--kv-transfer-backend", "tcp")
        for _ in range(2):
            c.start_role_worker("decode", "--kv-transfer-timeout", "2", "--kv-transfer-backend", "tcp")
        c.start_frontend("--router-mode", "kv", "--prefill-timeout", "3")
        c.wait_pools(prefill=2, decode=2)
        yield c
    finally:
        for proc in c.workers:
            if proc.alive():
                os.kill(proc.pid, signal.SIGCONT)
        c.stop()


async def test_prefill_worker_killed_under_load(fault_cluster: DisaggCluster) -> None:
    victim = fault_cluster.by_role("prefill")[0]
    await _run_streams(fault_cluster, 40, 40, victim.kill9)
    fm = fault_cluster.frontend_metrics()
    assert metric_sum(fm, "dynamo_frontend_disagg_decisions_total", mode="remote") > 0
    # The kill hit work in flight: a prefill or a transfer failed and was recovered from.
    assert _recoveries(fault_cluster) > 0


async def test_decode_worker_killed_after_transfer_migrates(fault_cluster: DisaggCluster) -> None:
    victim = fault_cluster.by_role("decode")[0]
    await _run_streams(fault_cluster, 24, 120, victim.kill9)
    assert metric_sum(fault_cluster.frontend_metrics(), "dynamo_frontend_model_migration_total") > 0


async def test_frozen_prefill_worker_stalls_nothing(fault_cluster: DisaggCluster) -> None:
    victim = fault_cluster.by_role("prefill")[0]
    await _run_streams(fault_cluster, 24, 40, lambda: os.kill(victim.pid, signal.SIGSTOP))
    assert _recoveries(fault_cluster) > 0
    os.kill(victim.pid, signal.SIGCONT)


async def test_local_fallback_without_prefill_pool(tmp_path) -> None:
    c = DisaggCluster(tmp_path, speedup=10.0)
    try:
        prefill = c.start_role_worker("prefill")
        c.start_role_worker("decode")
        c.start_frontend("--router-mode", "kv")
        c.wait_pools(prefill=1, decode=1)
        prefill.stop()
        wait_until(lambda: int(c.model_entry().get("prefill_ready", 0)) == 0, 20, what="prefill pool gone")
        async with _api(c) as api:
            raw = await api.completions.with_raw_response.create(
                model="tiny", prompt=LONG_PROMPT, max_tokens=8, extra_body={"ignore_eos": True}, extra_headers=_explain_on(),
            )
            assert raw.parse().usage.completion_tokens == 8
            route = explain(raw.headers)
            assert route["disagg"]["mode"] == "local" and route["disagg"]["reason"] == "no_prefill_workers", route
    finally:
        c.stop()


async def test_conditional_disagg_follows_thresholds(tmp_path) -> None:
    c = DisaggCluster(tmp_path, speedup=10.0)
    try:
        c.start_role_worker("prefill")
        c.start_role_worker("decode")
        c.start_frontend(
            "--router-mode", "kv", "--router-conditional-disagg",
            "--router-conditional-disagg-config", '{"policy": "isl_bounding", "eff_isl_threshold": 256, "eff_isl_ratio_threshold": 0.7}',
        )
        c.wait_pools(prefill=1, decode=1)
        async with _api(c) as api:

            async def route(prompt: str) -> dict:
                raw = await api.completions.with_raw_response.create(
                    model="tiny", prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True}, extra_headers=_explain_on(),
                )
                assert raw.parse().usage.completion_tokens == 4
                return explain(raw.headers)["disagg"]

            # Short prompt: nothing cached (ratio 1.0), but the whole prompt is below 256: local
            # (the ratio only guards prompts at least as long as the threshold).
            short = await route("a short question")
            assert short["mode"] == "local" and short["reason"] == "isl_bounding", short
            # Long and new: effective ISL above the threshold: remote.
            first = await route(LONG_PROMPT)
            assert first["mode"] == "remote", first
            assert first["effective_isl"] == first["isl"] > 256
            # The decode worker now caches the long prompt's blocks (its own KV events say so): the
            # same prompt plus a short tail has a small effective ISL and a low ratio: local.
            def cached_local() -> dict | None:
                info = asyncio.run_coroutine_threadsafe(route(LONG_PROMPT + " and one more line"), loop).result(30)
                return info if info["mode"] == "local" else None

            loop = asyncio.get_running_loop()
            again = await asyncio.to_thread(wait_until, cached_local, 20, 0.2, "a cached prompt prefilled locally")
            assert again["reason"] == "isl_bounding" and again["effective_isl"] < 256, again
    finally:
        c.stop()


async def test_cost_policy_keeps_a_short_prompt_local_and_sends_a_long_fresh_one_remote(tmp_path) -> None:
    """The issue's live check: 1 prefill + 1 decode worker, kv routing, ``--router-conditional-disagg``
    (the cost policy by default), ``x-dynamo-route-explain: 1``."""
    c = DisaggCluster(tmp_path, speedup=10.0)
    try:
        c.start_role_worker("prefill")
        c.start_role_worker("decode")
        c.start_frontend("--router-mode", "kv", "--router-conditional-disagg")
        c.wait_pools(prefill=1, decode=1)
        async with _api(c) as api:

            async def route(prompt: list[int]) -> dict:
                raw = await api.completions.with_raw_response.create(
                    model="tiny", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True}, extra_headers=_explain_on(),
                )
                assert raw.parse().usage.prompt_tokens == len(prompt)
                return explain(raw.headers)

            short = await route(list(range(100, 116)))
            assert (short["disagg"]["mode"], short["disagg"]["reason"]) == ("local", "cost_local"), short
            fresh = await route([(7 * i) % 4000 + 50 for i in range(5000)])  # vocabulary of 4,096
            assert (fresh["disagg"]["mode"], fresh["disagg"]["reason"]) == ("remote", "cost_remote"), fresh
            cost = fresh["disagg"]["cost"]
            assert cost["local_prefill_tokens"] == 5000 and cost["local_cost_ms"] > cost["remote_cost_ms"], cost
            assert fresh["prefill"]["worker_id"] == fresh["disagg"]["prefill_worker_id"]
            assert len(fresh["worker_id"]) == len(fresh["disagg"]["prefill_worker_id"]) == 16
    finally:
        c.stop()
