"""The KV router's credit for pinned prefixes (cache_control): a pinned prefix counts as cached on
its worker until the pin's TTL, with no KV event saying so and past approximate mode's own TTL;
whole blocks only; TTL classes never outlive the pin; a removed worker loses its credit."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.daemon.router.core.pinned_prefixes import ttl_class

BS = 16
PREFIX = list(range(1, 8 * BS + 1))  # 8 blocks
PROMPT = PREFIX + list(range(5000, 5000 + 2 * BS))


def _router(clock, **cfg) -> KvRouter:
    router = KvRouter(KvRouterConfig(**cfg), BS, clock=clock, rng=random.Random(0), registry=CollectorRegistry())
    router.update_workers([(1, 0), (2, 0), (3, 0)])
    return router


def test_a_pinned_prefix_counts_as_cached_on_its_worker_without_events_until_its_ttl(clock) -> None:
    router = _router(clock)
    assert router.best_worker("a", PROMPT).overlap_blocks == 0  # no event ever came
    router.credit_pin((2, 0), PROMPT, num_tokens=len(PREFIX) + 5, ttl_s=300)  # 8 whole blocks
    for _ in range(3):
        decision = router.best_worker("b", PROMPT)
        assert decision.worker == (2, 0) and decision.overlap_blocks == 8
    clock.advance(200)
    router.credit_pin((2, 0), PROMPT, num_tokens=len(PREFIX), ttl_s=300)  # pinned again: extended
    clock.advance(200)
    assert router.best_worker("c", PROMPT).overlap_blocks == 8
    clock.advance(101)
    assert router.best_worker("d", PROMPT).overlap_blocks == 0


def test_the_pin_outlasts_approximate_modes_own_ttl(clock) -> None:
    router = _router(clock, use_kv_events=False, router_ttl_secs=10)
    first = router.select_worker("a", PROMPT)
    router.free("a")
    router.credit_pin(first.worker, PROMPT, num_tokens=4 * BS, ttl_s=3600)
    clock.advance(11)  # the routed guess expired, the pinned 4 blocks did not
    again = router.best_worker("b", PROMPT)
    assert again.worker == first.worker and again.overlap_blocks == 4


def test_removed_worker_loses_its_credit_and_short_prefixes_are_not_credited(clock) -> None:
    router = _router(clock)
    router.credit_pin((3, 0), PROMPT, num_tokens=BS - 1, ttl_s=300)  # less than a block
    assert router.best_worker("a", PROMPT).overlap_blocks == 0
    router.credit_pin((3, 0), PROMPT, num_tokens=len(PREFIX), ttl_s=300)
    router.remove_worker(3)
    assert router.best_worker("b", PROMPT).overlap_blocks == 0
    assert router.pins.pinned_blocks() == 0


def test_ttl_classes_round_down_so_a_credit_never_outlives_its_pin() -> None:
    assert ttl_class(30.9) == 30.0
    assert ttl_class(300) == 300.0
    assert ttl_class(359) == 300.0
    assert ttl_class(3600) == 3600.0
