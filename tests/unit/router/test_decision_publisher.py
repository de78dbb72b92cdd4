"""The routing-decision publisher on a real ZMQ event plane: every decision arrives as its own
``PublishedDecision`` message, in order; decisions offered together go out in one send round."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from dynamod.daemon.router.core.decision_publisher import DecisionPublisher
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.events.plane import TOPIC_ROUTER_DECISIONS
from dynamod.shared.protocol.routing import CandidateScore, RoutingDecision, published_decision_decoder
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import poll

NS = "decisions"


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    settings = RuntimeSettings(namespace=NS, discovery_backend="mem", event_plane="zmq")
    rt = await DistributedRuntime.create(settings, store=MemStore())
    yield rt
    await rt.shutdown(grace_s=0)


def decision(request_id: str) -> RoutingDecision:
    return RoutingDecision(
        request_id=request_id, worker_id=7, overlap_blocks=1, request_blocks=3, isl=48, reason="lowest_cost",
        detail="cost 2.0 < 3.0", overlap_weight=1.0, temperature=0.0,
        candidates=[
            CandidateScore(7, 0, 1, 40, 2.5, 2, 4.5, 10),
            CandidateScore(8, 0, 0, 48, 3.0, 3, 6.0, 0),
        ],
    )


class CountingPublisher(DecisionPublisher):
    """Counts send rounds (how often the background task wakes up to publish)."""

    rounds = 0

    async def _send(self, batch: list) -> None:
        self.rounds += 1
        await super()._send(batch)


async def test_decisions_offered_together_go_out_in_one_round_as_messages_of_their_own(
    runtime: DistributedRuntime,
) -> None:
    pub = CountingPublisher(runtime, "frontend", flush_interval_s=0.05)
    await pub.start()
    sub = await runtime.events.subscribe(NS, "*", TOPIC_ROUTER_DECISIONS)
    it = sub.__aiter__()
    try:
        # ZMQ subscribers connect asynchronously: offer probes until one is heard.
        async def first_heard() -> None:
            n = 0
            while True:
                pub.offer(decision(f"probe-{n}"))
                n += 1
                try:
                    async with asyncio.timeout(0.2):
                        await anext(it)
                        return
                except TimeoutError:
                    continue

        await asyncio.wait_for(first_heard(), 10)
        rounds_before = pub.rounds
        published_before = pub.metrics.published._value.get()
        offered_at = time.time()
        for i in range(50):
            pub.offer(decision(f"burst-{i}"), model="tiny")
        got = []
        async with asyncio.timeout(10):
            while len(got) < 50:
                msg = published_decision_decoder.decode((await anext(it)).payload)
                if not msg.request_id.startswith("probe-"):  # probes still under way
                    got.append(msg)
        assert [d.request_id for d in got] == [f"burst-{i}" for i in range(50)]
        assert all(d.source == "frontend" and d.model == "tiny" and d.worker_id == 7 for d in got)
        assert all(d.router_instance_id == worker_id_hex(runtime.instance_id) for d in got)
        assert all(offered_at - 1 <= d.ts <= time.time() for d in got)  # when offered, not when sent
        assert [c.worker_id for c in got[0].candidates] == [7, 8]
        # Offered in one go, sent in one round (with any probe still queued).
        assert pub.rounds == rounds_before + 1
        assert pub.metrics.published._value.get() >= published_before + 50
    finally:
        await sub.close()
        await pub.close()


async def test_close_while_waiting_between_rounds_returns_promptly(runtime: DistributedRuntime) -> None:
    pub = DecisionPublisher(runtime, "frontend", flush_interval_s=30.0)
    await pub.start()
    assert pub.enabled
    pub.offer(decision("one"))
    pub.offer(decision("two"))

    async def both_sent() -> bool:
        return pub.metrics.published._value.get() >= 2

    await poll(both_sent, 5, "the first round to be sent")
    async with asyncio.timeout(2):  # the task sleeps 30 s before its next round
        await pub.close()
    assert not pub.enabled
    pub.offer(decision("after close"))  # ignored, no error


async def test_sample_rate_zero_publishes_nothing(runtime: DistributedRuntime) -> None:
    pub = DecisionPublisher(runtime, "frontend", sample_rate=0.0)
    await pub.start()
    assert not pub.enabled
    pub.offer(decision("x"))
    await pub.close()
