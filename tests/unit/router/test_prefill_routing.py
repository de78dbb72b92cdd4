"""The prefill pool's routing: prefix-aware (a worker caching the prompt computes less) and
queue-aware (prompts picked for a worker count as its queued prefill work until their attempt
ends), with the queue the disaggregation policy reads (``worker_load``)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.daemon.router.core.config import prefill_router_config
from dynamod.daemon.router.core.worker_load import decode_load, prefill_queue_tokens, queued_prefill_tokens
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.load import LoadMetrics

BS = 16
W1, W2 = (1, 0), (2, 0)


def _prefill_router(clock) -> KvRouter:
    router = KvRouter(prefill_router_config(KvRouterConfig()), BS, clock=clock, rng=random.Random(0), registry=CollectorRegistry())
    router.update_workers([W1, W2])
    return router


def _prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BS)]


def _cache(router: KvRouter, worker: tuple[int, int], tokens: list[int]) -> None:
    local, seq = hash_tokens(tokens, BS, None)
    router.apply_event(RouterEvent(worker_id=worker[0], dp_rank=worker[1], event_id=0,
                                   event=KvStored(parent_hash=None, blocks=[StoredBlock(s, h) for s, h in zip(seq, local, strict=True)])))


def test_a_burst_of_fresh_prompts_spreads_over_the_prefill_pool(clock) -> None:
    router = _prefill_router(clock)
    first = router.select_worker("a", _prompt(1, 200))
    assert prefill_queue_tokens(router, first) == 0  # nothing waited there before it
    second = router.select_worker("b", _prompt(2, 200))
    assert second.worker != first.worker  # the first one's 3,200 tokens wait there now
    third = router.select_worker("c", _prompt(3, 10))
    assert prefill_queue_tokens(router, third) == 200 * BS
    router.free("a")  # its prefill attempt ended (params arrived, failed or was not used)
    router.free("b")
    assert queued_prefill_tokens(router, third.worker) == 10 * BS  # only "c" waits
    fourth = router.best_worker("d", _prompt(4, 10))
    assert fourth.worker != third.worker and prefill_queue_tokens(router, fourth) == 0


def test_the_worker_caching_the_prompt_wins_unless_its_queue_outweighs_the_cache(clock) -> None:
    router = _prefill_router(clock)
    prompt = _prompt(7, 100)
    _cache(router, W1, prompt[: 90 * BS])
    assert router.best_worker("r", prompt).worker == W1  # 10 blocks to compute there, 100 elsewhere
    router.select_worker("long", _prompt(8, 300), allowed=[W1])  # 300 blocks queued on W1
    assert router.best_worker("r", prompt).worker == W2


def test_the_queue_read_by_the_policy_takes_the_larger_of_report_and_own_count(clock) -> None:
    router = _prefill_router(clock)
    router.select_worker("a", _prompt(1, 20), allowed=[W1])
    router.apply_load(LoadMetrics(worker_id=1, active_prefill_tokens=5000, num_running=3, total_blocks=1000, ts=clock()))
    decision = router.best_worker("b", _prompt(2, 4), allowed=[W1])
    assert prefill_queue_tokens(router, decision) == 5000
    load = decode_load(router, decision, 4 * BS)
    assert (load.queued_tokens, load.running) == (5000, 3)
    assert load.kv_fraction is not None and 0 < load.kv_fraction < 1
