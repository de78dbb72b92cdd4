"""The event plane's server goes away: the router keeps its index, adds what routing implies
(approximate mode on top), and re-reads every worker's cache when events are back."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import KvStored, RouterEvent, StoredBlock

BS = 16
OLD = list(range(1, 8 * BS + 1))  # cached on worker 1 before the outage
NEW = list(range(1000, 1000 + 8 * BS))  # first seen during the outage


def _router(clock, resyncs: list[int], **cfg) -> KvRouter:
    return KvRouter(
        KvRouterConfig(**cfg), BS, clock=clock, rng=random.Random(0), registry=CollectorRegistry(), on_resync=resyncs.append
    )


def _cache(router: KvRouter, worker_id: int, tokens: list[int], event_id: int) -> None:
    local, seq = hash_tokens(tokens, BS, None)
    blocks = [StoredBlock(s, h) for s, h in zip(seq, local, strict=True)]
    router.apply_event(RouterEvent(worker_id=worker_id, dp_rank=0, event_id=event_id, event=KvStored(parent_hash=None, blocks=blocks)))


def test_outage_routes_on_the_old_index_plus_what_it_routed_then_resyncs_everyone(clock) -> None:
    resyncs: list[int] = []
    router = _router(clock, resyncs)
    router.update_workers([(1, 0), (2, 0), (3, 0)])
    _cache(router, 1, OLD, 0)

    router.enter_events_outage()
    assert router.in_events_outage
    assert router.select_worker("a", OLD).worker == (1, 0)  # what the index knew still counts
    first = router.select_worker("b", NEW)
    assert first.overlap_blocks == 0
    router.free("b")
    again = router.select_worker("c", NEW)  # no event will ever say so: routing implies it
    assert again.worker == first.worker and again.overlap_blocks == 8
    router.free("c")
    clock.advance(KvRouterConfig().router_ttl_secs + 1)
    assert router.best_worker("d", NEW).overlap_blocks == 0  # the guess expired

    assert resyncs == []
    assert sorted(router.leave_events_outage()) == [1, 2, 3]
    assert sorted(resyncs) == [1, 2, 3] and not router.in_events_outage
    assert router.leave_events_outage() == []  # once


def test_outage_changes_nothing_in_approximate_mode(clock) -> None:
    resyncs: list[int] = []
    router = _router(clock, resyncs, use_kv_events=False)
    router.update_workers([(1, 0)])
    router.enter_events_outage()
    assert not router.in_events_outage
    assert router.leave_events_outage() == [] and resyncs == []


def test_removed_worker_leaves_the_outage_guesses(clock) -> None:
    router = _router(clock, [])
    router.update_workers([(1, 0), (2, 0)])
    router.enter_events_outage()
    won = router.select_worker("a", NEW).worker
    router.free("a")
    router.remove_worker(won[0])
    assert router.best_worker("b", NEW).overlap_blocks == 0
