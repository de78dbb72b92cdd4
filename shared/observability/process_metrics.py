"""Process health figures every daemon exports beside its own metrics: resident memory, open file
descriptors and CPU time (prometheus_client's standard ``process_*`` collector, which a private
registry does not get by default), and the number of asyncio tasks alive on the daemon's loop.

The task count is what a leak of fire-and-forget tasks looks like from outside (a stream handler
that never ends, a watch restarted without closing the old one); the soak benchmark reads it from
``/metrics`` and fails on growth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ASYNCIO_TASKS = "dynamo_process_asyncio_tasks"


class AsyncioTaskCollector(Collector):
    """Counts the tasks of one event loop at scrape time (the scrape runs on that loop, or in a
    thread of the same process: ``all_tasks(loop)`` is safe to call from either)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(ASYNCIO_TASKS, "asyncio tasks not yet done on the daemon's event loop")
        if not self._loop.is_closed():
            g.add_metric([], float(_task_count(self._loop)))
        yield g


def _task_count(loop: asyncio.AbstractEventLoop) -> int:
    # all_tasks() iterates a WeakSet that the loop's thread may change meanwhile; retry like the
    # stdlib does on "Set changed size during iteration".
    for _ in range(100):
        try:
            return len(asyncio.all_tasks(loop))
        except RuntimeError:
            continue
    return 0


def register_process_metrics(registry: CollectorRegistry, loop: asyncio.AbstractEventLoop) -> None:
    """Adds the ``process_*`` collector and the task gauge to ``registry`` (once per registry)."""
    if getattr(registry, "_dynamod_process_metrics", False):
        return
    ProcessCollector(registry=registry)
    registry.register(AsyncioTaskCollector(loop))
    registry._dynamod_process_metrics = True  # type: ignore[attr-defined]
