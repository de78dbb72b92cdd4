"""The router's wait queue by priority: higher first, FIFO within a priority, aging bounds how long
a low priority is passed over, and the queue wait is reported by priority class."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.daemon.router.core.wait_queue import WaitQueue
from dynamod.shared.errors import ConfigError

BS = 16
PROMPT = list(range(1, 4 * BS + 1))


class Gate:
    """Capacity the queued requests compete for: ``attempt`` takes a slot if one is open."""

    def __init__(self) -> None:
        self.slots = 0
        self.served: list[str] = []

    def attempt_for(self, name: str):
        def attempt() -> str | None:
            if self.slots <= 0:
                return None
            self.slots -= 1
            self.served.append(name)
            return name

        return attempt


async def _until(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0)


async def _enqueue(queue: WaitQueue, gate: Gate, clock, arrivals: list[tuple[float, str, int]]) -> list[asyncio.Task]:
    """Queues each (arrival time, name, priority) in order, moving ``clock`` to its arrival."""
    tasks = []
    for at, name, priority in arrivals:
        clock.now = at
        tasks.append(asyncio.create_task(queue.run(gate.attempt_for(name), priority=priority)))
        await _until(lambda n=len(tasks): len(queue) == n)
    return tasks


async def _release_one_at_a_time(queue: WaitQueue, gate: Gate, tasks: list[asyncio.Task]) -> list[str]:
    for served in range(1, len(tasks) + 1):
        gate.slots = 1
        queue.notify()
        await _until(lambda s=served: len(gate.served) == s)
    await asyncio.gather(*tasks)
    return gate.served


async def test_higher_priority_first_and_fifo_within_a_priority(clock):
    queue, gate = WaitQueue(64, 30.0, clock=clock), Gate()
    tasks = await _enqueue(queue, gate, clock, [
        (0.0, "normal-a", 0), (0.1, "normal-b", 0), (0.2, "high-a", 5), (0.3, "low", -3), (0.4, "high-b", 5),
    ])
    assert queue.queued_priorities() == [5, 5, 0, 0, -3]
    assert await _release_one_at_a_time(queue, gate, tasks) == ["high-a", "high-b", "normal-a", "normal-b", "low"]
    assert len(queue) == 0


async def test_aging_a_request_is_passed_only_by_those_arriving_within_the_priority_gap(clock):
    # One second per priority point: priority 5 is 5 s ahead. A normal request that has waited more
    # than 5 s is no longer passed by a new priority-5 request, however urgent the stream.
    queue, gate = WaitQueue(64, 30.0, priority_jump_s=1.0, clock=clock), Gate()
    tasks = await _enqueue(queue, gate, clock, [
        (100.0, "normal", 0), (104.0, "high-within-5s", 5), (106.0, "high-after-5s", 5), (107.0, "high-later", 5),
    ])
    order = await _release_one_at_a_time(queue, gate, tasks)
    assert order == ["high-within-5s", "normal", "high-after-5s", "high-later"]


async def test_a_jump_is_clamped_to_the_queue_timeout(clock):
    queue, gate = WaitQueue(64, 30.0, clock=clock), Gate()
    assert queue.jump_s(2**31 - 1) == 30.0 and queue.jump_s(-(2**31)) == -30.0 and queue.jump_s(3) == 3.0
    # The largest priority there is still does not pass a request that has waited past the timeout's worth.
    tasks = await _enqueue(queue, gate, clock, [(0.0, "normal", 0), (31.0, "max-priority", 2**31 - 1)])
    assert await _release_one_at_a_time(queue, gate, tasks) == ["normal", "max-priority"]


async def test_jump_zero_is_plain_fifo(clock):
    queue, gate = WaitQueue(64, 30.0, priority_jump_s=0.0, clock=clock), Gate()
    tasks = await _enqueue(queue, gate, clock, [(0.0, "a", -5), (0.1, "b", 9), (0.2, "c", 0)])
    assert await _release_one_at_a_time(queue, gate, tasks) == ["a", "b", "c"]


async def test_an_urgent_arrival_ahead_of_the_head_tries_at_once(clock):
    queue, gate = WaitQueue(64, 30.0, clock=clock), Gate()
    [low] = await _enqueue(queue, gate, clock, [(0.0, "low", -1)])
    gate.slots = 1  # capacity appeared without a notification (the head retries only on its timer)
    clock.now = 0.5
    assert await asyncio.wait_for(queue.run(gate.attempt_for("high"), priority=3), 5) == "high"
    assert not low.done()
    gate.slots = 1
    queue.notify()
    assert await asyncio.wait_for(low, 5) == "low"


async def test_every_request_reports_its_wait_with_its_priority(clock):
    waits: list[tuple[int, float]] = []
    queue, gate = WaitQueue(64, 30.0, clock=clock, on_wait=lambda p, s: waits.append((p, s))), Gate()
    gate.slots = 1
    assert await queue.run(gate.attempt_for("free"), priority=7) == "free"
    tasks = await _enqueue(queue, gate, clock, [(1.0, "queued", -2)])
    await _release_one_at_a_time(queue, gate, tasks)
    assert waits[0] == (7, 0.0)
    assert waits[1][0] == -2 and waits[1][1] > 0.0


def test_a_negative_jump_is_refused():
    with pytest.raises(ValueError, match="priority_jump_s"):
        WaitQueue(8, 1.0, priority_jump_s=-1.0)
    with pytest.raises(ConfigError, match="--router-priority-jump-secs"):
        KvRouterConfig(router_priority_jump_secs=float("nan")).validate()


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_kv_router_serves_the_urgent_waiter_first_and_says_so_in_metrics(clock):
    registry = CollectorRegistry()
    router = KvRouter(
        KvRouterConfig(active_prefill_tokens_threshold=0), BS, clock=clock, rng=random.Random(0), registry=registry
    )
    router.update_workers([(1, 0)])
    router.select_worker("hold", PROMPT)  # the only worker is busy: the next requests wait
    background = asyncio.create_task(router.select_worker_waiting("background", PROMPT, priority=-1))
    await _until(lambda: len(router.queue) == 1)
    clock.advance(0.5)
    urgent = asyncio.create_task(router.select_worker_waiting("urgent", PROMPT, priority=10))
    await _until(lambda: len(router.queue) == 2)
    router.free("hold")
    await asyncio.wait_for(urgent, 5)
    assert not background.done()  # "urgent" holds the worker's prefill capacity now
    router.mark_prefill_done("urgent")
    await asyncio.wait_for(background, 5)
    count = "dynamo_router_queue_wait_seconds_count"
    assert _sample(registry, count, priority_class="high") == 1
    assert _sample(registry, count, priority_class="low") == 1
    assert _sample(registry, count, priority_class="normal") == 0  # "hold" used select_worker: no queue
