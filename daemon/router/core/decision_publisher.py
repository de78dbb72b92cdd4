"""Publishes routing decisions on ``router_decisions`` for the console, off the request path.

Every KV routing decision (frontend ``--router-mode kv`` and the standalone router) is offered
here; ``offer`` is a constant-time append to a bounded drop-oldest queue, and one background task
encodes (a ``PublishedDecision``: the decision plus a timestamp and where it came from, msgpack)
and publishes. When the event plane is slower than the request rate the oldest decisions are dropped
and counted: an operator view must never slow a request down. ``--router-decision-sample-rate``
publishes only a share of them on very busy routers.

The task wakes at most once per ``FLUSH_INTERVAL_S`` and sends everything queued since, one
message per decision as before (the wire is unchanged): waking the task once per decision cost a
loop turn per request, several percent of a KV-routed request's frontend CPU, for a console that
redraws a few times a second. ``ts`` is still when the decision was offered.

Scope: ``{namespace}/{component}/router_decisions`` with the publisher's own component
(``frontend`` or the router's); the console subscribes to the topic on every component of the
namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from dynamod.shared.errors import ConfigError, DynamoError
from dynamod.shared.events.dropqueue import DropOldestQueue, QueueClosed
from dynamod.shared.events.plane import TOPIC_ROUTER_DECISIONS, EventPublisher
from dynamod.shared.observability.per_registry import PerRegistry
from dynamod.shared.protocol.routing import PublishedDecision, RoutingDecision, published_decision_encoder
from dynamod.shared.protocol.worker_id import worker_id_hex

if TYPE_CHECKING:
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 1024
# How long queued decisions may wait to be sent together. Far below what a person watching the
# console notices; at 1000 requests/s a send round carries ~20 decisions (the queue holds 1024).
FLUSH_INTERVAL_S = 0.02
ENV_SAMPLE_RATE = "DYN_ROUTER_DECISION_SAMPLE_RATE"


def add_decision_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router-decision-sample-rate",
        type=float,
        default=None,
        help="share (0..1) of KV routing decisions published on router_decisions for the console; "
        f"0 turns publishing off [env {ENV_SAMPLE_RATE}, default 1.0]",
    )


def sample_rate_from_args(args: argparse.Namespace) -> float:
    """Flag, else ``DYN_ROUTER_DECISION_SAMPLE_RATE``, else 1.0; within [0, 1]."""
    value = getattr(args, "router_decision_sample_rate", None)
    if value is None:
        text = os.environ.get(ENV_SAMPLE_RATE)
        try:
            value = float(text) if text else 1.0
        except ValueError:
            raise ConfigError(f"{ENV_SAMPLE_RATE}={text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"--router-decision-sample-rate must be within [0, 1], got {value}")
    return float(value)


class DecisionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter(
            "dynamo_router_decisions_published", "Routing decisions published on router_decisions", registry=registry
        )
        self.dropped = Counter(
            "dynamo_router_decisions_dropped",
            "Routing decisions not published because the event plane was slower than routing",
            registry=registry,
        )


# The decision metrics on a registry (created once: prometheus refuses duplicates).
decision_metrics = PerRegistry(DecisionMetrics)


class DecisionPublisher:
    """``offer(decision)`` from the routing path; ``start()``/``close()`` around the process."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        component: str,
        *,
        sample_rate: float = 1.0,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        rng: random.Random | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        self._rt = runtime
        self.component = component
        self.sample_rate = sample_rate
        self.flush_interval_s = flush_interval_s
        self._rng = rng or random.Random()
        self._queue: DropOldestQueue[tuple[RoutingDecision, float, str]] = DropOldestQueue(queue_size)
        self._pub: EventPublisher | None = None
        self._task: asyncio.Task[None] | None = None
        self._source = ""
        self.metrics = decision_metrics(runtime.registry)

    @property
    def enabled(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        if self.sample_rate <= 0.0 or self._rt.events is None:
            logger.info("router decisions not published sample_rate=%s event_plane=%s", self.sample_rate, self._rt.events is not None)
            return
        try:
            self._pub = await self._rt.namespace().component(self.component).publisher(TOPIC_ROUTER_DECISIONS)
        except DynamoError as exc:
            logger.warning("router decisions not published error=%s", exc)
            return
        self._source = worker_id_hex(self._rt.instance_id)
        self._task = asyncio.create_task(self._run(), name="router-decisions-out")
        logger.info(
            "router decisions published scope=%s/%s topic=%s sample_rate=%s",
            self._rt.settings.namespace, self.component, TOPIC_ROUTER_DECISIONS, self.sample_rate,
        )

    async def close(self) -> None:
        self._queue.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pub is not None:
            try:
                await self._pub.close()
            except DynamoError as exc:
                logger.debug("router decisions publisher close error=%s", exc)
            self._pub = None

    def offer(self, decision: RoutingDecision, model: str = "") -> None:
        """Queues ``decision`` for publishing (sampled); never waits."""
        if self._task is None:
            return
        if self.sample_rate < 1.0 and self._rng.random() >= self.sample_rate:
            return
        if not self._queue.put_nowait((decision, time.time(), model)):
            self.metrics.dropped.inc()

    async def _run(self) -> None:
        queue = self._queue
        while True:
            try:
                first = await queue.get()
            except QueueClosed:
                return
            batch = [first]
            while (item := queue.get_nowait()) is not None:
                batch.append(item)
            await self._send(batch)
            # Pace the rounds: what arrives meanwhile waits in the queue and goes in the next one.
            await asyncio.sleep(self.flush_interval_s)

    async def _send(self, batch: list[tuple[RoutingDecision, float, str]]) -> None:
        pub = self._pub
        assert pub is not None
        encode = published_decision_encoder.encode
        component, source = self.component, self._source
        published = failed = 0
        for decision, ts, model in batch:
            body = PublishedDecision.of(
                decision, ts=ts, source=component, router_instance_id=source, model=model
            )
            try:
                # ZMQ's PUB socket sends at once (a finished future: no loop turn per message).
                await pub.publish(TOPIC_ROUTER_DECISIONS, encode(body))
            except DynamoError as exc:
                failed += 1
                logger.debug("router decision not published error=%s", exc)
                continue
            published += 1
        if published:
            self.metrics.published.inc(published)
        if failed:
            self.metrics.dropped.inc(failed)
