"""Process figures on every daemon's /metrics: the asyncio task gauge follows the loop's tasks."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from dynamod.shared.observability.process_metrics import ASYNCIO_TASKS, register_process_metrics


def _tasks(registry: CollectorRegistry) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(ASYNCIO_TASKS + " "):
            return float(line.split()[1])
    raise AssertionError(f"{ASYNCIO_TASKS} missing")


async def test_task_gauge_counts_live_tasks_and_registers_once() -> None:
    registry = CollectorRegistry()
    register_process_metrics(registry, asyncio.get_running_loop())
    register_process_metrics(registry, asyncio.get_running_loop())  # a second runtime on the same registry
    base = _tasks(registry)
    gate = asyncio.Event()
    extra = [asyncio.create_task(gate.wait()) for _ in range(5)]
    assert _tasks(registry) == base + 5
    gate.set()
    await asyncio.gather(*extra)
    assert _tasks(registry) == base
    assert "process_resident_memory_bytes" in generate_latest(registry).decode()
