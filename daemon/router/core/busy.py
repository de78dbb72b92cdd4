"""Busy detection: which workers to skip because they are already full.

Thresholds follow Dynamo: ``--active-decode-blocks-threshold`` is a *share* of a worker's KV blocks
(0..1) and ``--active-prefill-tokens-threshold`` a token count; a worker strictly above either is
busy. The numbers come from the worker's own load metrics (``kv_metrics`` topic) while they are
fresh, because only the engine knows its real KV usage; otherwise from the router's own active
sequences, where the block share needs the worker's capacity (its model card's
``total_kv_blocks`` via ``set_capacity``, or the last metrics seen).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dynamod.daemon.router.core.active_sequences import ActiveSequences
from dynamod.shared.kv.indexer import WorkerKey
from dynamod.shared.protocol.load import LoadMetrics

BUSY_DECODE_BLOCKS = "decode_blocks"
BUSY_PREFILL_TOKENS = "prefill_tokens"


class BusyPolicy:
    def __init__(
        self,
        *,
        decode_blocks_threshold: float | None,
        prefill_tokens_threshold: int | None,
        metrics_max_age_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decode_blocks_threshold = decode_blocks_threshold
        self.prefill_tokens_threshold = prefill_tokens_threshold
        self.metrics_max_age_s = metrics_max_age_s
        self._clock = clock
        self._metrics: dict[WorkerKey, tuple[LoadMetrics, float]] = {}
        self._capacity: dict[WorkerKey, int] = {}

    @property
    def enabled(self) -> bool:
        return self.decode_blocks_threshold is not None or self.prefill_tokens_threshold is not None

    def update(self, metrics: LoadMetrics) -> None:
        key = (metrics.worker_id, metrics.dp_rank)
        self._metrics[key] = (metrics, self._clock())
        if metrics.total_blocks > 0:
            self._capacity[key] = metrics.total_blocks

    def set_capacity(self, worker: WorkerKey, total_blocks: int) -> None:
        """The worker's KV capacity in blocks (model card ``total_kv_blocks``)."""
        if total_blocks > 0:
            self._capacity[worker] = total_blocks

    def capacity(self, worker: WorkerKey) -> int:
        """The worker's KV capacity in blocks (0 when unknown)."""
        return self._capacity.get(worker, 0)

    def latest(self, worker: WorkerKey) -> LoadMetrics | None:
        """The worker's load metrics if fresh enough to trust."""
        entry = self._metrics.get(worker)
        if entry is None or self._clock() - entry[1] > self.metrics_max_age_s:
            return None
        return entry[0]

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self._metrics if k[0] == worker_id]:
            del self._metrics[key]
        for key in [k for k in self._capacity if k[0] == worker_id]:
            del self._capacity[key]

    def busy_reason(self, worker: WorkerKey, active: ActiveSequences) -> str | None:
        """Why ``worker`` is busy, or None when it may take a request."""
        decode_t = self.decode_blocks_threshold
        prefill_t = self.prefill_tokens_threshold
        if decode_t is None and prefill_t is None:
            return None
        metrics = self.latest(worker)
        if metrics is not None:
            blocks = metrics.active_decode_blocks
            tokens = metrics.active_prefill_tokens
            capacity = metrics.total_blocks or self._capacity.get(worker, 0)
            if decode_t is not None:
                share = blocks / capacity if capacity > 0 else metrics.kv_usage
                if share > decode_t:
                    return BUSY_DECODE_BLOCKS
        else:
            blocks = active.active_blocks(worker)
            tokens = active.active_prefill_tokens(worker)
            capacity = self._capacity.get(worker, 0)
            if decode_t is not None and capacity > 0 and blocks / capacity > decode_t:
                return BUSY_DECODE_BLOCKS
        if prefill_t is not None and tokens > prefill_t:
            return BUSY_PREFILL_TOKENS
        return None
