"""The encode worker's load record: what its encoder did over the last publishing interval, sent on
the event plane (``kv_metrics``, as every worker's load) so the console shows encoder busy time and
images/s per worker without scraping ``/metrics``.

The record is a ``LoadMetrics`` with the encode fields set and the KV fields at their defaults
(an encoder holds no KV), so every reader of ``kv_metrics`` decodes it; a reader older than the
encode fields ignores them. The embedding-cache side (agg/prefill workers) is
``EmbeddingReceiver.stamp_load``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dynamod.daemon.encode.encoder import BatchStats
from dynamod.shared.protocol.load import LoadMetrics

LOAD_INTERVAL_S = 1.0  # an encode worker publishes its load this often


class EncoderLoad:
    """Encoder time and images since start, turned into per-second figures between two reports.

    ``on_batch`` is fed each finished batch; ``report`` gives the figures since the previous report
    (the first covers the time since construction)."""

    def __init__(self, worker_id: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self._clock = clock
        self.images = 0  # encoded since start
        self.busy_s = 0.0  # encoder seconds since start
        self.inflight_images = 0  # queued or being encoded now (the service counts them)
        self._last_at = clock()
        self._last_images = 0
        self._last_busy_s = 0.0

    def on_batch(self, stats: BatchStats) -> None:
        self.images += stats.images
        self.busy_s += stats.seconds

    def report(self, status: str) -> LoadMetrics:
        """The load record for the interval since the previous call, stamped with wall time."""
        now = self._clock()
        elapsed = now - self._last_at
        busy = images_per_s = 0.0
        if elapsed > 0:
            # A batch is counted when it ends, so one that spans two intervals lands whole in the
            # second, which could then read above 1: capped, as a share of time cannot pass 1.
            busy = min(1.0, (self.busy_s - self._last_busy_s) / elapsed)
            images_per_s = (self.images - self._last_images) / elapsed
        self._last_at, self._last_images, self._last_busy_s = now, self.images, self.busy_s
        return LoadMetrics(
            worker_id=self.worker_id, status=status, ts=time.time(), encoder_busy=busy,
            encode_images_per_s=images_per_s, encode_inflight_images=self.inflight_images,
        )

