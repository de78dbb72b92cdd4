"""Migration with real processes: kill -9 a worker in the middle of 32 concurrent streams.

Every stream must complete with exactly ``max_tokens`` tokens as the client counts them (each
chunk carries its token ids, vLLM's ``return_token_ids`` extension, so a token sent twice or lost
shows up), and the frontend must report the migrations. A migrated stream is one trace in the
frontend's ``GET /v1/traces``: a ``migration`` span from the dead worker to its successor and a
``client_request`` span on each, all under the request's root.
"""

from __future__ import annotations

import asyncio
import re

import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster, cluster_fixture, get_json, get_text

pytestmark = pytest.mark.timeout(180)

STREAMS = 32
# Seconds of mocker time, so the kill lands mid-generation: the worker runs ahead of what the client
# has read (kernel buffers hold a stream's whole output), and on a loaded machine the client lags
# far behind; a short generation could be over on the worker while the client is at token 5.
MAX_TOKENS = 600


# A slower mocker keeps the streams running long enough to kill a worker in their middle.
cluster = cluster_fixture("migration-cluster", speedup=1.0)


def _request_id(index: int) -> str:
    return f"migration-stream-{index}"


async def _stream(api: openai.AsyncOpenAI, index: int, progress: list[int], workers: list[str]) -> tuple[int, int, str]:
    async with api.completions.with_streaming_response.create(
        model="tiny", prompt=f"stream number {index} tells a story", max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers={"x-request-id": _request_id(index)},
    ) as response:
        workers[index] = response.headers["x-dynamo-worker-instance-id"]
        received = 0
        usage_tokens = -1
        finish = ""
        async for chunk in await response.parse():
            if chunk.choices:
                choice = chunk.choices[0]
                received += len(getattr(choice, "token_ids", None) or [])
                progress[index] = received
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
    return received, usage_tokens, finish


async def _run(cluster: LocalCluster) -> None:
    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
    progress = [0] * STREAMS
    workers = [""] * STREAMS
    tasks = [asyncio.create_task(_stream(api, i, progress, workers)) for i in range(STREAMS)]

    async def all_started() -> None:
        while min(progress) < 5:  # noqa: ASYNC110 - polled with the deadline below
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)

    await asyncio.wait_for(all_started(), 60)
    assert not any(t.done() for t in tasks), "streams finished before the kill; slow the mocker down"
    victim = workers[0]
    victim_pid = cluster.instance_pid(victim)
    proc = next(p for p in cluster.workers if p.pid == victim_pid)
    on_victim = sum(1 for w in workers if w == victim)
    assert on_victim >= 1
    proc.kill9()
    results = await asyncio.gather(*tasks)
    for received, usage_tokens, finish in results:
        assert (received, usage_tokens, finish) == (MAX_TOKENS, MAX_TOKENS, "length")
    metrics = get_text(cluster.url + "/metrics")
    migrated = sum(
        float(v) for v in re.findall(r'dynamo_frontend_model_migration_total\{[^}]*model="tiny"[^}]*\} ([0-9.]+)', metrics)
    )
    assert migrated >= 1, "no stream was cut mid-generation: the test did not test migration"
    traced = [i for i, w in enumerate(workers) if w == victim and _check_migrated_trace(cluster, _request_id(i), victim)]
    assert traced, "no stream on the killed worker shows its migration in its trace"


def _check_migrated_trace(cluster: LocalCluster, request_id: str, victim: str) -> bool:
    """Checks one stream's trace as ``GET /v1/traces`` gives it; False when the stream did not
    migrate (its worker had generated everything before the kill)."""
    def ended() -> list[dict] | None:  # the root ends just after the stream's last chunk is sent
        got = get_json(f"{cluster.url}/v1/traces?request_id={request_id}")["data"]
        return got if any(s["parent_id"] is None for s in got) else None

    spans = wait_until(ended, 10, what=f"the root span of {request_id}")
    assert len({s["trace_id"] for s in spans}) == 1, spans
    [root] = [s for s in spans if s["parent_id"] is None]
    assert root["name"] == "http-request" and root["attributes"]["request_id"] == request_id
    migrations = [s for s in spans if s["name"] == "migration"]
    if not migrations:
        assert not root["attributes"].get("migrated"), root
        return False
    [move] = migrations
    successor = move["attributes"]["to_worker_id"]
    assert move["attributes"]["from_worker_id"] == victim and successor != victim, move
    assert move["parent_id"] == root["span_id"] and root["attributes"]["migrated"] is True
    attempts = {s["attributes"]["worker_id"]: s for s in spans if s["name"] == "client_request"}
    assert set(attempts) == {victim, successor}, spans
    assert all(a["parent_id"] == root["span_id"] for a in attempts.values())
    assert attempts[victim]["status"] == "error" and attempts[successor]["status"] == "ok"
    assert attempts[victim]["start_unix_ns"] <= move["start_unix_ns"] <= attempts[successor]["start_unix_ns"]
    assert root["attributes"]["worker_ids"].split(",") == [victim, successor]
    return True


def test_kill9_mid_stream_every_stream_completes(cluster: LocalCluster) -> None:
    asyncio.run(_run(cluster))
    # The dead worker leaves discovery within its lease TTL; the survivor keeps serving.
    wait_until(lambda: len(cluster.ready_workers()) == 1, 15, what="the dead worker to leave discovery")
    api = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=30)
    reply = api.completions.create(model="tiny", prompt="still there?", max_tokens=4, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
