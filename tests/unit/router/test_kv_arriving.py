"""A decode whose KV is fetched from a prefill worker counts as *arriving* on its decode worker:
no prefill tokens, and its blocks only from its first token on (issue 23: with the transfer
overlapped the decode is dispatched while the prefill still runs, and counting a long prompt's
blocks for all that time pushed every short request onto the other decode workers)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig, native
from dynamod.daemon.router.core.active_sequences import ActiveSequences
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.disagg_cluster import DisaggCluster
from tests.unit.frontend.test_app import FakeWorker

BS = 16
W = (7, 0)
LONG = list(range(1, 64 * BS + 1))  # 64 full blocks
SHORT_A = list(range(100_000, 100_000 + 2 * BS))
SHORT_B = list(range(200_000, 200_000 + 2 * BS))
SHORT_C = list(range(300_000, 300_000 + 2 * BS))

CORES = [pytest.param(None, id="python")]
if native.core is not None:
    CORES.append(pytest.param(native.core, id="native"))


@pytest.mark.parametrize("core", CORES)
def test_arriving_request_counts_its_blocks_from_its_first_token(clock, core):
    active = ActiveSequences(BS, clock=clock, core=core)
    active.add("short", W, [1, 2], 2 * BS, 2 * BS)
    active.add("remote", W, [1, 2, 3, 4], 4 * BS + 3, 4 * BS + 3, arriving=True)
    assert active.arriving("remote") and not active.arriving("short")
    assert active.active_blocks(W) == 2  # only the local request's
    assert active.active_prefill_tokens(W) == 2 * BS  # the remote prompt is not computed here
    assert active.load(W).requests == 2
    assert active.shared_prefixes([1, 2, 3, 4]) == {W: 2}  # its blocks are not there yet
    assert active.mark_prefill_done("remote")  # its first token: the KV landed
    assert not active.arriving("remote")
    assert active.active_blocks(W) == 5  # 1, 2 shared; 3, 4 and the partial tail
    assert active.active_prefill_tokens(W) == 2 * BS
    assert active.shared_prefixes([1, 2, 3, 4]) == {W: 4}
    assert not active.mark_prefill_done("remote")
    active.free("remote")
    assert active.active_blocks(W) == 2 and active.load(W).requests == 1
    active.free("short")
    assert active.load(W) is None and active.shared_prefixes([1, 2]) == {}


@pytest.mark.parametrize("core", CORES)
def test_arriving_request_freed_or_expired_before_its_kv_leaves_nothing(clock, core):
    active = ActiveSequences(BS, ttl_s=60, clock=clock, core=core)
    active.add("gone", W, [1, 2], 2 * BS, 2 * BS, arriving=True)
    assert active.free("gone")
    assert active.load(W) is None
    active.add("stale", W, [1, 2], 2 * BS, 2 * BS, arriving=True)
    clock.advance(61)
    assert active.expire() == ["stale"]
    assert active.load(W) is None and active.shared_prefixes([1, 2]) == {}


async def test_short_requests_are_not_pushed_off_a_worker_whose_long_kv_is_still_arriving(clock):
    router = KvRouter(KvRouterConfig(), BS, clock=clock, rng=random.Random(0), registry=CollectorRegistry())
    one, two = (1, 0), (2, 0)
    router.update_workers([one, two])
    router.select_worker("short-a", SHORT_A, allowed=[two])  # worker two runs a short decode
    await router.select_worker_waiting("long", LONG, allowed=[one], kv_arriving=True)
    # The long prompt is still prefilled remotely: worker one holds nothing yet, so it is cheaper.
    decision = await router.select_worker_waiting("short-b", SHORT_B)
    assert decision.worker == one
    costs = {(c.worker_id, c.dp_rank): c for c in decision.candidates}
    assert costs[one].decode_blocks == 2 and costs[two].decode_blocks == 4  # active + its own 2
    router.free("short-b")
    router.mark_prefill_done("long")  # its first token: it decodes on worker one with 64 blocks
    decision = await router.select_worker_waiting("short-c", SHORT_C)
    assert decision.worker == two
    costs = {(c.worker_id, c.dp_rank): c for c in decision.candidates}
    assert costs[one].decode_blocks == 64 + 2


@dataclass
class GatedDecode(FakeWorker):
    """A decode worker that sends its first token only once ``gate`` is set: its KV is 'arriving'."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.requests.append(body)
        await self.gate.wait()
        self.requests.pop()  # FakeWorker.handler records it again
        async for out in super().handler(body, ctx):
            yield out


async def test_frontend_counts_a_remotely_prefilled_decode_as_arriving_until_its_first_token() -> None:
    c = DisaggCluster("--prefill-timeout", "5", "--router-mode", "kv", "--no-router-kv-events")
    await c.start()
    decode: GatedDecode | None = None
    try:
        decode = await c._add(GatedDecode, "backend", "tiny")
        await c.add_prefill()
        assert c.routers is not None and c.routers._kv is not None
        kv = c.routers._kv.groups["tiny"].kv
        key = (decode.id, 0)
        prompt = list(range(1, 101))  # 7 blocks of 16
        async with httpx.AsyncClient(base_url=c.url, timeout=20) as raw:
            task = asyncio.create_task(
                raw.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3})
            )
            await c.wait(lambda: len(decode.requests) == 1 and len(kv.active) == 1 and kv.active.load(key) is not None)
            (request_id,) = list(kv.active._seqs)
            assert kv.active.arriving(request_id)
            assert kv.active.active_blocks(key) == 0 and kv.active.active_prefill_tokens(key) == 0
            decode.gate.set()
            resp = await task
        assert resp.status_code == 200
        await c.wait(lambda: len(kv.active) == 0)
    finally:
        if decode is not None:
            decode.gate.set()  # a failed assertion must not leave the request hanging
        await c.stop()
