"""A router that starts after the workers cached prompts rebuilds its index from their ``kv_dump``.

The prompts are sent to the workers directly (no router sees their KV events), one prompt per
worker; a router started afterwards must still know which worker holds which prompt, answer
``best_worker_id`` with the full overlap and route a repeat of the prompt there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.integration.frontend.test_frontend_support import LocalCluster
from tests.integration.router.test_router_role import (
    BLOCK,
    RouterProc,
    answer_with_overlap,
    best,
    endpoint_client,
    poll,
    prompt,
    request,
    run_stream,
    runtime_settings,
    start_workers,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("router-recovery"), speedup=20.0) as c:
        start_workers(c, 2)
        yield c


@pytest.fixture
async def rt(cluster: LocalCluster) -> AsyncIterator[DistributedRuntime]:
    runtime = await DistributedRuntime.create(runtime_settings(cluster))
    try:
        yield runtime
    finally:
        await runtime.shutdown(1)


async def test_late_router_rebuilds_its_index_from_kv_dump(cluster: LocalCluster, rt: DistributedRuntime) -> None:
    workers = await endpoint_client(rt, "backend", "generate", count=2)
    ids = [inst.instance_id for inst in workers.instances]
    prompts = {wid: prompt(60 + n, 10) for n, wid in enumerate(ids)}
    for wid, tokens in prompts.items():
        outs = await run_stream(workers, request(f"direct-{wid:x}", tokens, max_tokens=2), instance_id=wid)
        assert outs[-1]["finish_reason"] == "length"

    router = RouterProc(cluster, "late-router")
    try:
        router.wait_ready(2)
        best_client = await endpoint_client(rt, "router", "best_worker_id")
        for wid, tokens in prompts.items():
            answer = await poll(lambda t=tokens: answer_with_overlap(best_client, t), 10.0, "index rebuilt from kv_dump")
            assert answer["worker_id"] == wid
            assert answer["overlap_blocks"] == 10
        # Routing for real: each repeat goes to its holder and hits its cache.
        generate = await endpoint_client(rt, "router", "generate")
        for wid, tokens in prompts.items():
            outs = await run_stream(generate, request(f"repeat-{wid:x}", tokens, max_tokens=2))
            assert outs[0]["worker_id"] == wid
            assert outs[-1]["usage"].get("cached_tokens", 0) >= 9 * BLOCK
        # A prompt nobody cached has no overlap anywhere: the index holds only what the dumps said.
        fresh = await best(best_client, prompt(99, 10))
        assert fresh["overlap_blocks"] == 0
        assert await asyncio.to_thread(router.metric, "dynamo_router_kv_resyncs_total") >= 2
    finally:
        router.proc.stop()
