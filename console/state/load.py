"""Per-worker load tallies: what the event plane and the frontends say about each instance id.

Keyed by instance id alone, not by worker, because load can arrive before discovery shows the
worker (or after it is gone): the topology attaches a worker to its tally when it registers, and a
tally nobody claims is dropped after ``ORPHAN_STATS_TTL_S``. KV transfer rates come from the same
``kv_metrics`` messages, so the transfer tracker lives here too.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynamod.console.state.records import Worker, WorkerStats
from dynamod.console.state.tiers import KvTierTracker
from dynamod.console.state.transfers import KvTransferTracker
from dynamod.console.state.versions import Versions
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, RouterEvent
from dynamod.shared.protocol.load import LoadMetrics

ORPHAN_STATS_TTL_S = 30.0  # load from an id discovery never showed is dropped after this


class LoadTally:
    """``WorkerStats`` per instance id, the transfer tracker, and how many updates were taken."""

    def __init__(self, versions: Versions) -> None:
        self._versions = versions
        self.stats: dict[int, WorkerStats] = {}
        self.transfers = KvTransferTracker()
        self.tiers = KvTierTracker()
        self.load_updates = 0
        self.kv_events = 0

    def stats_for(self, instance_id: int) -> WorkerStats:
        """The tally for ``instance_id``, created empty on first use (no allocation on a hit)."""
        st = self.stats.get(instance_id)
        if st is None:
            st = self.stats[instance_id] = WorkerStats()
        return st

    def apply_load(self, m: LoadMetrics, now: float) -> None:
        """A ``kv_metrics`` message. Hot path: 256 workers x 10/s, so no allocation beyond the dict."""
        st = self.stats_for(m.worker_id)
        st.loads[m.dp_rank] = m
        st.last_load_at = now
        self.transfers.observe(m, now)
        self.tiers.observe(m, now)
        self.load_updates += 1
        self._versions.load += 1

    def apply_kv_event(self, ev: RouterEvent) -> int | None:
        """Counts blocks and sequence gaps. Returns how many blocks a cache clear dropped (the caller
        reports it), ``None`` for any other event."""
        st = self.stats_for(ev.worker_id)
        if st.last_event_id >= 0 and ev.event_id > st.last_event_id + 1:
            st.kv_gaps += 1
            st.kv_seeded = False  # events were lost: the count drifts until a fresh kv_dump
        st.last_event_id = max(st.last_event_id, ev.event_id)
        st.kv_events += 1
        self.kv_events += 1
        self._versions.load += 1
        event = ev.event
        if isinstance(event, KvStored):
            st.cached_blocks += len(event.blocks)
            delta: int | None = len(event.blocks)
        elif isinstance(event, KvRemoved):
            st.cached_blocks = max(0, st.cached_blocks - len(event.block_hashes))
            delta = -len(event.block_hashes)
        elif isinstance(event, KvCleared):
            cleared = st.cached_blocks
            st.cached_blocks = 0
            if not st.kv_seeded:
                st.kv_unseeded.append((ev.event_id, None))
            return cleared
        else:
            return None
        if not st.kv_seeded:
            st.kv_unseeded.append((ev.event_id, delta))
        return None

    def apply_kv_seed(self, worker_id: int, blocks: int, event_id: int) -> None:
        """A worker's ``kv_dump``: ``blocks`` cached as of its event ``event_id`` (-1: unknown, an
        empty dump). Events newer than the dump that arrived meanwhile are applied on top, so a
        console started after traffic shows the cache the worker holds, not 0."""
        st = self.stats_for(worker_id)
        count = blocks
        if event_id >= 0:
            for eid, delta in st.kv_unseeded:
                if eid > event_id:
                    count = 0 if delta is None else max(0, count + delta)
            st.last_event_id = max(st.last_event_id, event_id)
        st.cached_blocks = count
        st.kv_seeded = True
        st.kv_unseeded.clear()
        self._versions.load += 1

    def note_routed(self, instance_id: int) -> None:
        """A router decision chose this worker."""
        self.stats_for(instance_id).routed += 1

    def apply_latencies(
        self,
        ttft: Mapping[int, float],
        itl: Mapping[int, float],
        ttft_by: Mapping[tuple[int, str], float] | None = None,
        itl_by: Mapping[tuple[int, str], float] | None = None,
        now: float = 0.0,
    ) -> None:
        """The latest per-worker TTFT and ITL a frontend measured: the headline figure, and by
        where the prompt was prefilled (``local`` | ``remote``) for like-with-like comparisons,
        with when each last changed (``now``)."""
        for wid, v in ttft.items():
            self.stats_for(wid).ttft_s = v
        for wid, v in itl.items():
            self.stats_for(wid).itl_s = v
        for name, by in (("ttft", ttft_by), ("itl", itl_by)):
            for (wid, prefill), v in (by or {}).items():
                st = self.stats_for(wid)
                figures: dict[str, float] = st.ttft_by if name == "ttft" else st.itl_by
                if figures.get(prefill) != v:
                    figures[prefill] = v
                    st.latency_changed_at[f"{name}:{prefill}"] = now
        if ttft or itl:
            self._versions.load += 1

    def worker_gone(self, worker: Worker) -> None:
        """Its last load is no longer true (the history stays), nor is its last transfer rate."""
        worker.stats.loads.clear()
        self.transfers.forget(worker.instance_id)
        self.tiers.forget(worker.instance_id)

    def sample_history(self) -> None:
        """One sparkline sample per worker (the once-a-second tick)."""
        for st in self.stats.values():
            st.history.append(st.load_value)
            st.samples += 1

    def prune(self, now: float, live_ids: set[int]) -> None:
        """Drops tallies no known worker claims and that have not been fed for a while."""
        for iid, st in list(self.stats.items()):
            if iid not in live_ids and now - st.last_load_at > ORPHAN_STATS_TTL_S:
                del self.stats[iid]
        self.transfers.retain(set(self.stats))
        self.tiers.retain(set(self.stats))
