"""Load metrics from vLLM's own scheduler statistics.

vLLM hands every engine step's ``SchedulerStats`` (running and waiting requests, KV cache usage,
prefix cache queries and hits) to the stat loggers it was given. ``LoadTracker`` keeps the latest
per data-parallel rank and the running prefix-hit totals; ``make_stat_logger_factory`` builds the
``StatLoggerBase`` subclass vLLM calls (defined on demand, since it subclasses a vLLM class).

With a KV connector, ``connector_prefix_cache_stats`` counts the prompt tokens the connector loaded
instead of the engine computing them: with the host tier (offload.py), the tokens onboarded from host
memory, kept per rank as ``connector_hits``.

An idle engine sends no more stats, so the last ones can say "1 running" after that request has
ended or been aborted; the adapter knows better (no request in flight) and the tracker is told so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynamod.shared.protocol.load import LoadMetrics


@dataclass(slots=True)
class RankLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    connector_hits: int = 0  # prompt tokens a KV connector loaded (the host tier's onboarded tokens)
    steps: int = 0


class LoadTracker:
    """Latest scheduler stats per rank. ``record`` may run on any thread (vLLM's output handler
    runs on the event loop today, but the stat logger interface does not promise it)."""

    def __init__(self, data_parallel_size: int = 1) -> None:
        self._lock = threading.Lock()
        self._ranks = {r: RankLoad() for r in range(max(1, data_parallel_size))}
        self.total_blocks_per_rank = 0

    def record(self, rank: int, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        with self._lock:
            load = self._ranks.setdefault(rank, RankLoad())
            load.num_running = int(getattr(scheduler_stats, "num_running_reqs", 0) or 0)
            load.num_waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0) or 0)
            load.kv_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0)
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                if getattr(prefix, "reset", False):
                    load.prefix_queries = load.prefix_hits = 0
                load.prefix_queries += int(getattr(prefix, "queries", 0) or 0)
                load.prefix_hits += int(getattr(prefix, "hits", 0) or 0)
            connector = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
            if connector is not None:
                load.connector_hits += int(getattr(connector, "hits", 0) or 0)
            load.steps += 1

    def connector_hits(self, rank: int) -> int:
        with self._lock:
            load = self._ranks.get(rank)
            return load.connector_hits if load is not None else 0

    def snapshot(self, worker_id: int, *, idle: bool, status: str, ts: float) -> list[LoadMetrics]:
        total = self.total_blocks_per_rank
        out = []
        with self._lock:
            for rank in sorted(self._ranks):
                load = self._ranks[rank]
                usage = 0.0 if idle else min(max(load.kv_usage, 0.0), 1.0)
                out.append(
                    LoadMetrics(
                        worker_id=worker_id,
                        dp_rank=rank,
                        active_decode_blocks=round(usage * total),
                        kv_usage=usage,
                        total_blocks=total,
                        num_waiting=0 if idle else load.num_waiting,
                        num_running=0 if idle else load.num_running,
                        prefix_hit_rate=load.prefix_hits / load.prefix_queries if load.prefix_queries else 0.0,
                        status=status,
                        ts=ts,
                    )
                )
        return out


def make_stat_logger_factory(tracker: LoadTracker) -> Callable[[Any, int], Any]:
    """A vLLM ``StatLoggerFactory`` feeding ``tracker`` (imports vLLM)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _DynamodStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            tracker.record(engine_idx, scheduler_stats)

        def log_engine_initialized(self) -> None:
            return None

    return _DynamodStatLogger
