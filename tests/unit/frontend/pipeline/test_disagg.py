"""Disaggregated serving through the real frontend: the prefill stage, its fallbacks, the policy,
and what the client and the operator see (headers, usage, /health, metrics, published decisions)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from dynamod.shared.protocol.routing import STAGE_DECODE, STAGE_PREFILL, RoutingDecision
from dynamod.shared.protocol.worker_id import worker_id_hex
from tests.unit.frontend.disagg_cluster import DisaggCluster
from tests.unit.frontend.test_app import expected_text

EXPLAIN = {"x-dynamo-route-explain": "1"}
PROMPT = list(range(1, 101))  # 100 tokens: 6 full blocks of 16 and a partial one


async def _cluster(*flags: str) -> DisaggCluster:
    c = DisaggCluster("--prefill-timeout", "1", *flags)
    await c.start()
    return c


@pytest.fixture
async def cluster() -> AsyncIterator[DisaggCluster]:
    c = await _cluster()
    try:
        yield c
    finally:
        await c.stop()


async def _complete(c: DisaggCluster, prompt: list[int] = PROMPT, max_tokens: int = 4, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=c.url, timeout=20) as raw:
        return await raw.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **kw},
                              headers=EXPLAIN)


async def _metrics(c: DisaggCluster) -> str:
    async with httpx.AsyncClient(base_url=c.url) as raw:
        return (await raw.get("/metrics")).text


async def test_remote_prefill_params_reach_decode_and_cached_tokens_come_from_prefill(cluster: DisaggCluster) -> None:
    decode = await cluster.add_decode(cached_tokens=99)  # what the decode side says must not be reported
    prefill = await cluster.add_prefill(cached_tokens=8)
    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=20)
    reply = await api.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
    assert reply.choices[0].text == expected_text(len(PROMPT), 5)
    assert reply.usage.prompt_tokens_details.cached_tokens == 8

    sent = prefill.requests[-1]
    assert sent["prefill_only"] is True and sent["stop"]["max_tokens"] == 1 and sent["token_ids"] == PROMPT
    got = decode.requests[-1]
    assert got["disaggregated_params"] == prefill.params(sent)
    assert got["stop"]["max_tokens"] == 5 and not got.get("prefill_only")

    stream = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 8
    assert decode.requests[-1]["disaggregated_params"]["transfer_id"] == f"t-{prefill.requests[-1]['request_id']}"

    text = await _metrics(cluster)
    assert 'dynamo_frontend_disagg_decisions_total{mode="remote",model="tiny",reason="always"} 2.0' in text
    assert 'dynamo_frontend_prefill_duration_seconds_count{model="tiny"} 2.0' in text
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        entry = (await raw.get("/health")).json()["models"][0]
    assert entry["ready"] == 1 and entry["prefill_ready"] == 1 and entry["prefill_workers"] == [worker_id_hex(prefill.id)]


async def test_route_explain_names_both_stages_and_the_decision(cluster: DisaggCluster) -> None:
    decode = await cluster.add_decode()
    prefill = await cluster.add_prefill()
    resp = await _complete(cluster)
    assert resp.status_code == 200
    explain = json.loads(resp.headers["x-dynamo-route-explain"])
    assert explain["worker_id"] == worker_id_hex(decode.id) and explain["stage"] == STAGE_DECODE
    assert explain["prefill"]["worker_id"] == worker_id_hex(prefill.id) and explain["prefill"]["stage"] == STAGE_PREFILL
    assert explain["disagg"]["mode"] == "remote" and explain["disagg"]["reason"] == "always"
    assert explain["disagg"]["prefill_worker_id"] == worker_id_hex(prefill.id) and explain["disagg"]["isl"] == len(PROMPT)


async def test_prefill_card_before_decode_cards_attaches_when_the_model_appears(cluster: DisaggCluster) -> None:
    prefill = await cluster.add_prefill()
    assert cluster.state is not None and "tiny" not in cluster.state.registry.models
    decode = await cluster.add_decode()
    assert (await _complete(cluster)).status_code == 200
    assert len(prefill.requests) == 1 and decode.requests[-1]["disaggregated_params"]["worker_id"] == prefill.id


async def test_failed_prefill_tries_another_prefill_worker(cluster: DisaggCluster) -> None:
    decode = await cluster.add_decode()
    bad = await cluster.add_prefill(mode="error")
    good = await cluster.add_prefill()
    for _ in range(2):  # round-robin: the failing worker is picked first at least once
        assert (await _complete(cluster)).status_code == 200
    assert len(bad.requests) >= 1 and len(good.requests) == 2
    assert all(r["disaggregated_params"]["worker_id"] == good.id for r in decode.requests)
    text = await _metrics(cluster)
    assert f'dynamo_frontend_prefill_failures_total{{model="tiny",reason="error"}} {len(bad.requests)}.0' in text
    assert 'dynamo_frontend_disagg_decisions_total{mode="remote",model="tiny",reason="always"} 2.0' in text


async def test_prefill_failing_everywhere_falls_back_to_local_prefill(cluster: DisaggCluster) -> None:
    decode = await cluster.add_decode(cached_tokens=3)
    hang = await cluster.add_prefill(mode="hang")  # no params within --prefill-timeout 1
    empty = await cluster.add_prefill(mode="no_params")
    resp = await _complete(cluster)
    assert resp.status_code == 200
    assert len(hang.requests) == 1 and len(empty.requests) == 1
    assert decode.requests[-1].get("disaggregated_params") is None
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3  # the decode worker's own
    explain = json.loads(resp.headers["x-dynamo-route-explain"])
    assert explain["disagg"]["mode"] == "local" and explain["disagg"]["reason"] == "prefill_failed"
    await asyncio.wait_for(hang.closed.wait(), 5)  # the timed-out prefill was cancelled on its worker
    text = await _metrics(cluster)
    for reason in ("timeout", "no_params"):
        assert f'dynamo_frontend_prefill_failures_total{{model="tiny",reason="{reason}"}} 1.0' in text
    assert 'dynamo_frontend_disagg_decisions_total{mode="local",model="tiny",reason="prefill_failed"} 1.0' in text


async def test_no_prefill_worker_prefills_locally(cluster: DisaggCluster) -> None:
    prefill = await cluster.add_prefill()
    decode = await cluster.add_decode()
    await prefill.lease.revoke()  # the pool is gone; the model stays disaggregated
    assert cluster.state is not None
    await cluster.wait(lambda: not cluster.state.registry.prefill_pools["tiny"].workers)  # type: ignore[union-attr]
    resp = await _complete(cluster)
    assert resp.status_code == 200 and decode.requests[-1].get("disaggregated_params") is None
    assert json.loads(resp.headers["x-dynamo-route-explain"])["disagg"]["reason"] == "no_prefill_workers"
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        assert (await raw.get("/health")).json()["models"][0]["prefill_ready"] == 0


async def test_decode_role_alone_is_disaggregated_and_prefills_locally(cluster: DisaggCluster) -> None:
    decode = await cluster.add_decode()
    resp = await _complete(cluster)
    assert resp.status_code == 200 and decode.requests[-1].get("disaggregated_params") is None
    assert json.loads(resp.headers["x-dynamo-route-explain"])["disagg"]["reason"] == "no_prefill_workers"


async def test_without_decode_fallback_no_prefill_worker_is_a_503() -> None:
    c = await _cluster("--no-decode-fallback")
    try:
        decode = await c.add_decode()
        resp = await _complete(c)
        assert resp.status_code == 503 and "retry-after" in resp.headers
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert "decode fallback" in resp.json()["error"]["message"] and not decode.requests
        await c.add_prefill(mode="error")
        resp = await _complete(c)
        assert resp.status_code == 503 and "prefill failed" in resp.json()["error"]["message"]
        assert not decode.requests
    finally:
        await c.stop()


async def test_isl_bounding_prefills_locally_what_the_decode_worker_caches() -> None:
    # Approximate KV mode: the decode router assumes a routed prompt is cached where it went.
    c = await _cluster(
        "--router-mode", "kv", "--no-router-kv-events", "--router-conditional-disagg",
        "--router-conditional-disagg-config", '{"policy": "isl_bounding", "eff_isl_threshold": 50}',
    )
    try:
        decode = await c.add_decode()
        await c.add_prefill()
        first = await _complete(c)
        second = await _complete(c)
        one = json.loads(first.headers["x-dynamo-route-explain"])["disagg"]
        two = json.loads(second.headers["x-dynamo-route-explain"])["disagg"]
        assert (one["mode"], one["reason"], one["effective_isl"]) == ("remote", "isl_above_threshold", 100)
        # 96 of 100 tokens cached on the decode worker: 4 left (< 50, ratio 0.04 < 0.7).
        assert (two["mode"], two["reason"], two["effective_isl"]) == ("local", "isl_bounding", 4)
        assert decode.requests[0]["disaggregated_params"] and decode.requests[1].get("disaggregated_params") is None
        other = await _complete(c, prompt=list(range(500, 600)))  # nothing cached: remote again
        assert json.loads(other.headers["x-dynamo-route-explain"])["disagg"]["mode"] == "remote"
    finally:
        await c.stop()


async def test_cost_policy_explains_a_local_short_and_a_remote_long_prompt_in_route_explain() -> None:
    # The in-process model's context is 512 tokens: a fast link and a doubled interference weight
    # make a 480-token fresh prompt what a 5k one is with the defaults.
    c = await _cluster("--router-mode", "kv", "--router-conditional-disagg", "--router-conditional-disagg-config",
                       '{"transfer_bandwidth_gb_s": 1000, "interference_weight": 2}')
    try:
        decode = await c.add_decode()
        prefill = await c.add_prefill()
        short = await _complete(c, prompt=list(range(1, 17)))
        long_ = await _complete(c, prompt=list(range(1000, 1480)))
        assert short.status_code == long_.status_code == 200
        for resp, mode in ((short, "local"), (long_, "remote")):
            body = json.loads(resp.headers["x-dynamo-route-explain"])
            info = body["disagg"]
            assert (info["policy"], info["mode"], info["reason"]) == ("cost", mode, f"cost_{mode}"), info
            assert info["decode_worker_id"] == body["worker_id"] == worker_id_hex(decode.id)
            assert info["prefill_worker_id"] == worker_id_hex(prefill.id)
            assert resp.headers["x-dynamo-worker-instance-id"] == worker_id_hex(decode.id)
            cost = info["cost"]
            assert cost["compute_model"] == "profile:mocker.json"
            assert (cost["local_cost_ms"] <= cost["remote_cost_ms"]) == (mode == "local")
        assert len(prefill.requests) == 1 and len(prefill.requests[0]["token_ids"]) == 480
        # Each first token taught its own path, in its prompt's size class, what it cost beyond
        # the prediction.
        stage = c.state.dispatcher.prefill_stage
        assert (stage.local_overhead.samples(16), stage.remote_overhead.samples(16)) == (1, 0)
        assert (stage.local_overhead.samples(480), stage.remote_overhead.samples(480)) == (0, 1)
    finally:
        await c.stop()


async def test_prefill_load_sends_prompts_local_while_the_prefill_worker_is_busy() -> None:
    c = await _cluster(
        "--router-conditional-disagg",
        "--router-conditional-disagg-config", '{"policy": "prefill_load", "prefill_busy_threshold": 50}',
    )
    try:
        decode = await c.add_decode()
        prefill = await c.add_prefill(hold=asyncio.Event())
        slow = asyncio.create_task(_complete(c))  # 100 prompt tokens in flight on the prefill worker
        await c.wait(lambda: len(prefill.requests) == 1)
        busy = await _complete(c)
        assert json.loads(busy.headers["x-dynamo-route-explain"])["disagg"]["reason"] == "prefill_busy"
        assert prefill.hold is not None
        prefill.hold.set()
        done = await slow
        assert json.loads(done.headers["x-dynamo-route-explain"])["disagg"]["reason"] == "prefill_not_busy"
        idle = await _complete(c)
        assert json.loads(idle.headers["x-dynamo-route-explain"])["disagg"]["mode"] == "remote"
        assert len(prefill.requests) == 2 and len(decode.requests) == 3
    finally:
        await c.stop()


async def test_early_params_start_decode_while_prefill_runs_and_cancel_closes_both(cluster: DisaggCluster) -> None:
    decode = await cluster.add_decode(delay_s=0.05)
    prefill = await cluster.add_prefill(mode="early")
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True}
        async with raw.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break  # decode streams while the prefill stream is still open
            assert decode.requests and not prefill.closed.is_set()
    # The client hung up: the decode request is aborted and the prefill stream closed.
    await asyncio.wait_for(decode.aborted.wait(), 5)
    await asyncio.wait_for(prefill.closed.wait(), 5)
    assert cluster.state is not None
    await cluster.wait(lambda: cluster.state is not None and cluster.state.inflight == 0)


async def test_early_params_stream_completes_after_prefill_finishes(cluster: DisaggCluster) -> None:
    decode = await cluster.add_decode()
    prefill = await cluster.add_prefill(mode="early")
    task = asyncio.create_task(_complete(cluster, max_tokens=6))
    await cluster.wait(lambda: len(decode.requests) == 1)
    prefill.release.set()
    resp = await task
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected_text(len(PROMPT), 6)
    await asyncio.wait_for(prefill.closed.wait(), 5)


async def test_migration_prefills_again_with_generated_tokens(cluster: DisaggCluster) -> None:
    a = await cluster.add_decode(fail_after=2)
    b = await cluster.add_decode()
    prefill = await cluster.add_prefill()
    resp = await _complete(cluster, max_tokens=6)
    if not a.requests:  # round-robin started on b: the next one starts on a
        resp = await _complete(cluster, max_tokens=6)
    assert resp.json()["choices"][0]["text"] == expected_text(len(PROMPT), 6)
    again = prefill.requests[-1]
    assert again["token_ids"][: len(PROMPT)] == PROMPT and len(again["token_ids"]) == len(PROMPT) + 2
    assert b.requests[-1]["disaggregated_params"] == prefill.params(again)


async def test_kv_mode_publishes_prefill_and_decode_decisions() -> None:
    c = await _cluster("--router-mode", "kv", "--no-router-kv-events")
    try:
        decode = await c.add_decode()
        prefill = await c.add_prefill()
        assert c.routers is not None and c.routers._kv is not None
        offered: list[RoutingDecision] = []
        c.routers._kv.decisions.offer = lambda d, model="": offered.append(d)  # type: ignore[method-assign]
        resp = await _complete(c)
        assert resp.status_code == 200
        stages = {d.stage: d for d in offered}
        assert set(stages) == {STAGE_PREFILL, STAGE_DECODE}
        assert stages[STAGE_PREFILL].worker_id == prefill.id
        dec = stages[STAGE_DECODE]
        assert dec.worker_id == decode.id and dec.overlap_weight == 1.0  # cache credit: cached blocks do not travel
        assert dec.disagg is not None and dec.disagg.mode == "remote" and dec.disagg.prefill_worker_id == prefill.id
    finally:
        await c.stop()
