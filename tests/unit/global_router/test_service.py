"""The global router in-process (mem discovery, fake pool routers on the real request plane): it
registers like a worker with the pools' model card, routes by the grid (request targets, the
``--default-*`` targets, priority overrides), retries on a faster pool only before the first output,
and leaves discovery on stop. Also: the frontend carries ``nvext`` targets to the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest
from dynamod.daemon.global_router.config import config_from_dict
from dynamod.daemon.global_router.service import ROLE, GlobalRouterService, GlobalRouterServiceConfig
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import DynamoError, InvalidRequestError, RemoteError, UnavailableError
from dynamod.shared.protocol.instance import decode_instance
from dynamod.shared.protocol.keys import instance_key, mdc_key
from dynamod.shared.protocol.llm import PreprocessedRequest, RoutingHints, SlaTargets, StopConditions
from dynamod.shared.protocol.model_card import MODEL_TYPE_PREFILL, ModelCard, decode_card, encode_card
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.transport.plane import RequestContext
from tests.unit.global_router.grids import agg_grid, disagg_grid

SHORT = list(range(1, 101))  # ISL 100: the grid's short bucket
LONG = list(range(1, 701))  # ISL 700: the long bucket


@dataclass
class FakePoolRouter:
    """A pool's router: streams ``tokens`` outputs, or fails the way ``fail`` says."""

    namespace: str
    lease: Any
    fail: str | None = None  # "raise" | "error_frame" | "after_first" | "invalid"
    tokens: int = 3
    requests: list[dict] = field(default_factory=list)

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.requests.append(body)
        if self.fail == "raise":
            raise UnavailableError(f"{self.namespace} has no capacity (test)")
        if self.fail == "invalid":
            raise InvalidRequestError("prompt too long (test)")
        if self.fail == "error_frame":
            yield {"token_ids": [], "finish_reason": "error", "error": "engine failed (test)"}
            return
        for i in range(self.tokens):
            if self.fail == "after_first" and i == 1:
                raise UnavailableError("broke mid-stream (test)")
            out: dict[str, Any] = {"token_ids": [i + 1], "worker_id": self.lease.id}
            if i == self.tokens - 1:
                out["finish_reason"] = "length"
            yield out


class Harness:
    def __init__(self, grid: dict[str, Any], **config: Any) -> None:
        self.store = MemStore()
        self.grid = grid
        self.config = GlobalRouterServiceConfig(**config)
        self.rt: DistributedRuntime | None = None
        self.service: GlobalRouterService | None = None
        self.pools: dict[str, FakePoolRouter] = {}

    async def start(self) -> None:
        settings = RuntimeSettings(discovery_backend="mem", event_plane="zmq", lease_ttl_s=5.0)
        self.rt = await DistributedRuntime.create(settings, store=self.store, events=False)
        self.service = GlobalRouterService(self.rt, config_from_dict(self.grid), self.config)
        await self.service.start()

    async def add_pool(self, namespace: str, *, prefill: bool = False, **kwargs: Any) -> FakePoolRouter:
        """A pool router in ``namespace`` and one worker card there (what a pool's workers publish)."""
        assert self.rt is not None
        lease = await self.rt.create_lease()
        pool = FakePoolRouter(namespace, lease, **kwargs)
        card = ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR), context_length=2048, kv_block_size=16)
        if prefill:
            card.model_types = [MODEL_TYPE_PREFILL]
        await self.rt.namespace(namespace).component("router").endpoint("generate").serve(pool.handler, lease=lease, role="router")
        await self.store.put(mdc_key(namespace, "prefill" if prefill else "backend", "generate", lease.id), encode_card(card), lease)
        self.pools[namespace] = pool
        return pool

    async def call(self, body: Any, endpoint: str = "generate") -> list[dict]:
        assert self.rt is not None
        client = await self.rt.namespace().component("global_router").endpoint(endpoint).client()
        try:
            await client.wait_for_instances(1, timeout=5)
            return [out async for out in client.generate(body, timeout_s=10)]
        finally:
            await client.close()

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop(0.5)
        if self.rt is not None:
            await self.rt.shutdown(grace_s=0.5)


def request(tokens: list[int], *, ttft: float | None = None, itl: float | None = None, priority: int | None = None) -> dict:
    req = PreprocessedRequest(
        request_id=f"r-{len(tokens)}-{ttft}-{priority}", model="tiny", token_ids=tokens,
        stop=StopConditions(max_tokens=3),
        router=None if ttft is None and itl is None else SlaTargets(ttft_target=ttft, itl_target=itl),
        routing=None if priority is None else RoutingHints(priority=priority),
    )
    return msgspec.to_builtins(req)


async def until(predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
    return value


def metric(h: Harness, name: str, **labels: str) -> float:
    assert h.rt is not None
    return h.rt.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def agg() -> AsyncIterator[Harness]:
    h = Harness(agg_grid(enable_priority_retry=True))
    await h.start()
    try:
        await h.add_pool("fast")
        await h.add_pool("slow")
        assert h.service is not None
        await until(lambda: "agg" in h.service.published)  # type: ignore[union-attr]
        yield h
    finally:
        await h.stop()


async def test_registers_like_a_worker_with_the_pools_card_and_its_pools_label(agg: Harness) -> None:
    assert agg.rt is not None and agg.service is not None
    key = mdc_key("dynamo", "global_router", "generate", agg.rt.instance_id)
    card = decode_card(await agg.store.get(key) or b"")
    assert card.served_model_name == "tiny" and card.context_length == 2048 and card.kv_block_size == 16
    inst = decode_instance(await agg.store.get(instance_key("dynamo", "global_router", "generate", agg.rt.instance_id)) or b"")
    assert inst.role == ROLE == "global-router"
    assert inst.labels["pools"] == "fast,slow" and inst.labels["mode"] == "agg"
    assert agg.rt.ready_probe_extra["pools"] == {"fast": 1, "slow": 1}


@pytest.mark.parametrize(
    ("body", "pool", "reason"),
    [
        (request(SHORT), "slow", "grid"),  # no target: the middle of the TTFT range is relaxed
        (request(SHORT, ttft=100), "fast", "grid"),  # a tight TTFT target
        (request(LONG), "fast", "grid"),  # a long prompt
        (request(SHORT, priority=50), "fast", "priority_override"),
        (request(SHORT, ttft=100, priority=5), "fast", "grid"),  # no rule covers 5
    ],
)
async def test_requests_land_in_the_pool_the_grid_picks(agg: Harness, body: dict, pool: str, reason: str) -> None:
    outs = await agg.call(body)
    assert outs[0]["pool"] == pool and [o["token_ids"] for o in outs] == [[1], [2], [3]]
    assert len(agg.pools[pool].requests) == 1 and agg.pools[pool].requests[0]["token_ids"] == body["token_ids"]
    assert metric(agg, "dynamo_global_router_selections_total", stage="agg", pool=pool, reason=reason) == 1
    assert metric(agg, "dynamo_global_router_requests_total", stage="agg", pool=pool) == 1


async def test_default_target_flag_applies_when_the_request_has_none() -> None:
    h = Harness(agg_grid(), default_ttft_target_ms=50.0)
    await h.start()
    try:
        await h.add_pool("fast")
        await h.add_pool("slow")
        assert (await h.call(request(SHORT)))[0]["pool"] == "fast"
        assert (await h.call(request(SHORT, ttft=900)))[0]["pool"] == "slow"  # the request's own target wins
    finally:
        await h.stop()


@pytest.mark.parametrize("fail", ["raise", "error_frame"])
async def test_a_pool_failing_before_its_first_output_is_retried_on_a_faster_pool(agg: Harness, fail: str) -> None:
    agg.pools["slow"].fail = fail
    outs = await agg.call(request(SHORT))
    assert outs[0]["pool"] == "fast" and outs[-1]["finish_reason"] == "length"
    assert len(agg.pools["slow"].requests) == 1 and len(agg.pools["fast"].requests) == 1
    assert metric(agg, "dynamo_global_router_retries_total", stage="agg", from_pool="slow", to_pool="fast") == 1
    assert metric(agg, "dynamo_global_router_pool_failures_total", stage="agg", pool="slow") == 1


async def test_a_failure_after_the_first_output_is_not_retried(agg: Harness) -> None:
    agg.pools["slow"].fail = "after_first"
    got: list[dict] = []
    with pytest.raises(UnavailableError, match="broke mid-stream"):
        got.extend(await agg.call(request(SHORT)))
    assert not agg.pools["fast"].requests
    assert metric(agg, "dynamo_global_router_retries_total", stage="agg", from_pool="slow", to_pool="fast") == 0


async def test_a_bad_request_is_not_retried(agg: Harness) -> None:
    agg.pools["slow"].fail = "invalid"
    with pytest.raises(InvalidRequestError, match="prompt too long"):
        await agg.call(request(SHORT))
    assert not agg.pools["fast"].requests


async def test_the_fastest_pool_failing_has_nowhere_to_go_and_is_not_blamed_on_the_global_router(agg: Harness) -> None:
    agg.pools["fast"].fail = "raise"
    with pytest.raises(DynamoError) as info:
        await agg.call(request(SHORT, ttft=100))
    # Not an UnavailableError: the frontend would migrate away from (and wait for) the global router.
    assert isinstance(info.value, RemoteError) and info.value.public_code == "pool_unavailable"
    assert info.value.http_status == 503 and not agg.pools["slow"].requests


async def test_without_priority_retry_a_failing_pool_fails_the_request() -> None:
    h = Harness(agg_grid())
    await h.start()
    try:
        await h.add_pool("fast")
        await h.add_pool("slow", fail="raise")
        with pytest.raises(RemoteError, match="slow failed before its first output"):
            await h.call(request(SHORT))
        assert not h.pools["fast"].requests
    finally:
        await h.stop()


async def test_a_pool_without_a_ready_router_is_retried_on_a_faster_pool() -> None:
    h = Harness(agg_grid(enable_priority_retry=True))
    await h.start()
    try:
        await h.add_pool("fast")
        assert h.service is not None
        await until(lambda: "agg" in h.service.published)  # type: ignore[union-attr]
        outs = await h.call(request(SHORT))  # the grid says slow, which has no router at all
        assert outs[0]["pool"] == "fast"
        assert metric(h, "dynamo_global_router_pool_failures_total", stage="agg", pool="slow") == 1
    finally:
        await h.stop()


async def test_disagg_mode_serves_prefill_and_decode_and_routes_each_by_its_grid() -> None:
    h = Harness(disagg_grid())
    await h.start()
    try:
        for ns in ("p0", "p1"):
            await h.add_pool(ns, prefill=True)
        for ns in ("d0", "d1"):
            await h.add_pool(ns)
        assert h.service is not None and h.rt is not None
        await until(lambda: set(h.service.published) == {"prefill", "decode"})  # type: ignore[union-attr]
        prefill_card = decode_card(await h.store.get(h.service.published["prefill"]) or b"")
        decode_card_ = decode_card(await h.store.get(h.service.published["decode"]) or b"")
        assert prefill_card.model_types == [MODEL_TYPE_PREFILL] and "chat" in decode_card_.model_types
        assert (await h.call(request(SHORT, ttft=200), "prefill_generate"))[0]["pool"] == "p1"
        assert (await h.call(request(SHORT, ttft=20), "prefill_generate"))[0]["pool"] == "p0"
        assert (await h.call(request(SHORT, itl=30), "decode_generate"))[0]["pool"] == "d1"
        assert (await h.call(request(LONG * 6, itl=30), "decode_generate"))[0]["pool"] == "d0"
    finally:
        await h.stop()


async def test_stop_withdraws_the_instance_and_the_card(agg: Harness) -> None:
    assert agg.rt is not None and agg.service is not None
    card_key = agg.service.published["agg"]
    await agg.service.stop(0.5)
    agg.service = None
    assert await agg.store.get(card_key) is None
    assert await agg.store.get(instance_key("dynamo", "global_router", "generate", agg.rt.instance_id)) is None


def test_frontend_carries_nvext_targets_and_priority_to_the_request() -> None:
    body = b'{"model":"tiny","messages":[],"nvext":{"router":{"ttft_target":100,"itl_target":20},"agent_hints":{"priority":7}}}'
    req = msgspec.json.decode(body, type=ChatCompletionRequest)
    assert req.nvext is not None
    assert req.nvext.sla_targets() == SlaTargets(ttft_target=100.0, itl_target=20.0)
    assert req.nvext.routing_hints() == RoutingHints(priority=7)
    plain = msgspec.json.decode(b'{"model":"tiny","messages":[],"nvext":{"ignore_eos":true}}', type=ChatCompletionRequest)
    assert plain.nvext is not None and plain.nvext.sla_targets() is None and plain.nvext.routing_hints() is None
    with pytest.raises(msgspec.ValidationError, match="nvext.router.ttft_target"):
        msgspec.json.decode(b'{"model":"tiny","messages":[],"nvext":{"router":{"ttft_target":-1}}}', type=ChatCompletionRequest)
