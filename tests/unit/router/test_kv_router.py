"""The KvRouter facade: KV-aware choice, explain output, overrides, busy workers and the queue."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import HEADER_NAME, KvRouter, KvRouterConfig
from dynamod.daemon.router.core.busy import BUSY_DECODE_BLOCKS, BUSY_PREFILL_TOKENS
from dynamod.shared.errors import InvalidRequestError, NoInstancesError, OverloadedError
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.load import LoadMetrics

BS = 16
PROMPT = list(range(1, 8 * BS + 1))  # 8 full blocks


def _router(clock, **cfg) -> KvRouter:
    import random

    return KvRouter(KvRouterConfig(**cfg), BS, clock=clock, rng=random.Random(0), registry=CollectorRegistry())


def _cache(router: KvRouter, worker: tuple[int, int], tokens: list[int], event_id: int = 0, lora: str | None = None) -> None:
    """The worker reports it stored the prompt's blocks (engine hashes = our sequence hashes)."""
    local, seq = hash_tokens(tokens, BS, lora)
    router.apply_event(
        RouterEvent(
            worker_id=worker[0],
            dp_rank=worker[1],
            event_id=event_id,
            event=KvStored(parent_hash=None, blocks=[StoredBlock(s, h) for s, h in zip(seq, local, strict=True)]),
        )
    )


async def _until(predicate, timeout: float = 5.0) -> None:
    """Yields to the loop until ``predicate()`` holds (no fixed sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0)


def test_routes_to_the_worker_caching_the_prompt_and_explains_why(clock):
    router = _router(clock)
    router.update_workers([(1, 0), (2, 0), (2, 1)])
    _cache(router, (2, 1), PROMPT[: 6 * BS])
    decision = router.select_worker("req-1", PROMPT)
    assert decision.worker == (2, 1)
    assert decision.overlap_blocks == 6 and decision.request_blocks == 8
    by_worker = {(c.worker_id, c.dp_rank): c for c in decision.candidates}
    assert by_worker[(2, 1)].cost == 2 + 2  # 2 blocks to prefill, 2 new blocks to hold (6 cached)
    assert by_worker[(1, 0)].cost == 8 + 8
    assert by_worker[(2, 1)].tree_size == 6
    header = json.loads(decision.to_header())
    assert HEADER_NAME == "x-dynamo-route-explain"
    assert (header["worker_id"], header["dp_rank"], header["overlap_blocks"], header["reason"]) == (
        "0000000000000002", 1, 6, "lowest_cost"
    )
    assert header["candidates"][0] == {
        "worker_id": "0000000000000002", "dp_rank": 1, "overlap_blocks": 6, "prefill_tokens": 2 * BS,
        "prefill_blocks": 2.0, "decode_blocks": 2, "cost": 4.0,
    }
    full = decision.to_dict()
    assert full["request_id"] == "req-1" and len(full["candidates"]) == 3
    json.dumps(full)  # publishable as is
    # The request now counts on its worker.
    assert router.active.active_blocks((2, 1)) == 8
    assert router.active.active_prefill_tokens((2, 1)) == 2 * BS


def test_load_spreads_identical_requests_without_cache(clock):
    router = _router(clock)
    router.update_workers([(1, 0), (2, 0), (3, 0)])
    chosen = {router.select_worker(f"r{i}", [i * 1000 + t for t in range(4 * BS)]).worker for i in range(3)}
    assert chosen == {(1, 0), (2, 0), (3, 0)}


def test_best_worker_does_not_register(clock):
    router = _router(clock)
    router.update_workers([(1, 0)])
    router.best_worker("peek", PROMPT)
    assert len(router.active) == 0


def test_per_request_overrides_and_allowed(clock):
    router = _router(clock)
    router.update_workers([(1, 0), (2, 0)])
    _cache(router, (1, 0), PROMPT)
    router.select_worker("busy-1", [9] * (20 * BS))  # lands on worker 2 (no cache anywhere)
    assert router.active.worker_of("busy-1") == (2, 0)
    # Weight 0 ignores the cache: worker 1 still wins on load (2 holds 20 blocks).
    assert router.best_worker("a", PROMPT, overlap_weight=0.0).worker == (1, 0)
    # Only worker 2 allowed.
    assert router.best_worker("b", PROMPT, allowed=[(2, 0)]).worker == (2, 0)
    sampled = router.best_worker("c", PROMPT, temperature=1.0)
    assert sampled.reason == "sampled" and sampled.temperature == 1.0
    with pytest.raises(NoInstancesError):
        router.best_worker("d", PROMPT, allowed=[(9, 0)])
    with pytest.raises(InvalidRequestError):
        router.best_worker("e", PROMPT, overlap_weight=-1)
    with pytest.raises(InvalidRequestError):
        router.best_worker("f", PROMPT, temperature=float("nan"))


def test_lora_requests_do_not_match_base_model_cache(clock):
    router = _router(clock)
    router.update_workers([(1, 0), (2, 0)])
    _cache(router, (1, 0), PROMPT)
    assert router.best_worker("base", PROMPT).overlap_blocks == 8
    assert router.best_worker("lora", PROMPT, lora_name="adapter").overlap_blocks == 0
    _cache(router, (2, 0), PROMPT, event_id=0, lora="adapter")
    assert router.best_worker("lora", PROMPT, lora_name="adapter").worker == (2, 0)


def test_no_workers_is_no_instances(clock):
    router = _router(clock)
    with pytest.raises(NoInstancesError):
        router.select_worker("r", PROMPT)


def test_metrics_record_overhead_events_and_hit_rate(clock):
    registry = CollectorRegistry()
    router = KvRouter(KvRouterConfig(), BS, clock=clock, registry=registry)
    router.update_workers([(1, 0)])
    _cache(router, (1, 0), PROMPT[: 4 * BS])
    router.select_worker("r", PROMPT)

    def value(name: str, labels: dict | None = None) -> float:
        return registry.get_sample_value(name, labels or {})

    for stage in ("hashing", "find_matches", "scheduling"):
        assert value(f"dynamo_router_overhead_{stage}_seconds_count") == 1
    assert value("dynamo_router_kv_events_total", {"event_type": "stored", "outcome": "applied"}) == 1
    assert value("dynamo_router_kv_hit_rate") == 0.5
    assert value("dynamo_router_decisions_total", {"reason": "only_candidate"}) == 1
    # A second router on the same registry shares the collectors instead of failing.
    KvRouter(KvRouterConfig(), BS, registry=registry)


# ----------------------------------------------------------------------------------------------
# Busy workers.


def test_busy_by_load_metrics_skips_the_worker(clock):
    router = _router(clock, active_decode_blocks_threshold=0.5)
    router.update_workers([(1, 0), (2, 0)])
    _cache(router, (1, 0), PROMPT)
    router.apply_load(LoadMetrics(worker_id=1, active_decode_blocks=60, total_blocks=100))
    router.apply_load(LoadMetrics(worker_id=2, active_decode_blocks=50, total_blocks=100))  # not above
    decision = router.select_worker("r", PROMPT)
    assert decision.worker == (2, 0)
    assert decision.busy == [(1, 0, BUSY_DECODE_BLOCKS)]
    header = json.loads(decision.to_header())
    assert header["busy_total"] == 1
    assert header["busy"] == [{"worker_id": "0000000000000001", "dp_rank": 0, "reason": BUSY_DECODE_BLOCKS}]


def test_busy_falls_back_to_own_counts_when_metrics_are_stale(clock):
    router = _router(clock, active_prefill_tokens_threshold=100, router_load_max_age_secs=5)
    router.update_workers([(1, 0), (2, 0)])
    router.apply_load(LoadMetrics(worker_id=1, active_prefill_tokens=500))
    assert router.best_worker("a", PROMPT).busy == [(1, 0, BUSY_PREFILL_TOKENS)]
    clock.advance(6)  # metrics too old: the router's own counts (nothing routed) apply
    assert router.best_worker("b", PROMPT).busy == []


def test_prefill_threshold_with_own_counts_then_overloaded(clock):
    router = _router(clock, active_prefill_tokens_threshold=100)
    router.update_workers([(1, 0), (2, 0)])
    first = router.select_worker("r1", [1] * 200)
    second = router.select_worker("r2", [2] * 200)
    assert {first.worker, second.worker} == {(1, 0), (2, 0)}
    with pytest.raises(OverloadedError):
        router.select_worker("r3", [3] * 200)
    router.mark_prefill_done("r1")  # its prompt is done: that worker takes work again
    assert router.select_worker("r3", [3] * 200).worker == first.worker


def test_decode_threshold_with_capacity_from_model_card(clock):
    router = _router(clock, active_decode_blocks_threshold=0.5)
    router.update_workers([(1, 0)])
    router.set_worker_capacity((1, 0), 16)
    router.select_worker("r1", [1] * (9 * BS))  # 9 of 16 blocks
    with pytest.raises(OverloadedError):
        router.select_worker("r2", [2] * BS)
    router.free("r1")
    router.select_worker("r2", [2] * BS)


def _busy_router(clock, holder: str) -> KvRouter:
    """One worker, busy with request ``holder`` and no prefill room left: the next request must wait."""
    router = _router(clock, active_prefill_tokens_threshold=0)
    router.update_workers([(1, 0)])
    router.select_worker(holder, PROMPT)
    return router


async def test_waiting_request_gets_the_worker_when_one_frees(clock):
    router = _busy_router(clock, "first")
    waiting = asyncio.create_task(router.select_worker_waiting("second", PROMPT))
    await _until(lambda: len(router.queue) == 1)
    assert not waiting.done()
    router.free("first")
    decision = await asyncio.wait_for(waiting, 5)
    assert decision.worker == (1, 0) and "second" in router.active
    assert len(router.queue) == 0


async def test_waiters_are_served_in_order(clock):
    router = _busy_router(clock, "hold")
    a = asyncio.create_task(router.select_worker_waiting("a", PROMPT))
    await _until(lambda: len(router.queue) == 1)
    b = asyncio.create_task(router.select_worker_waiting("b", PROMPT))
    await _until(lambda: len(router.queue) == 2)
    router.free("hold")
    await asyncio.wait_for(a, 5)
    assert not b.done()  # "a" now holds the worker's prefill capacity
    router.mark_prefill_done("a")
    await asyncio.wait_for(b, 5)


async def test_queue_timeout_and_full_queue_are_overloaded(clock):
    router = _router(clock, active_prefill_tokens_threshold=0, router_queue_size=1, router_queue_timeout_secs=0.05)
    router.update_workers([(1, 0)])
    router.select_worker("hold", PROMPT)
    waiting = asyncio.create_task(router.select_worker_waiting("a", PROMPT, timeout_s=5))
    await _until(lambda: len(router.queue) == 1)
    with pytest.raises(OverloadedError, match="queue is full"):
        await router.select_worker_waiting("b", PROMPT)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(router.queue) == 0
    with pytest.raises(OverloadedError, match="busy for 0.05 s"):
        await router.select_worker_waiting("c", PROMPT)
    assert "c" not in router.active


def test_a_request_never_freed_stops_counting_after_its_ttl(clock):
    router = _router(clock, active_prefill_tokens_threshold=0, router_active_sequence_ttl_secs=60)
    router.update_workers([(1, 0)])
    router.select_worker("lost", PROMPT)  # its frontend task died: never freed
    with pytest.raises(OverloadedError):
        router.select_worker("next", PROMPT)
    clock.advance(61)
    assert router.select_worker("next", PROMPT).worker == (1, 0)
    assert "lost" not in router.active
