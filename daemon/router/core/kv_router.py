"""The KV-aware router's facade: what the frontend (and the standalone router role) calls.

It ties together the KV index (shared/kv/indexer.py; fed by workers' KV events, or by its own
decisions in approximate mode, shared/kv/approx.py), the router's view of each worker's active
requests (active_sequences.py), busy detection (busy.py), the cost-based scheduler
(scheduler.py) and the bounded wait queue (wait_queue.py). No I/O happens here: the caller feeds
events, load metrics and worker lists in and gets decisions out, so a trace replay with a
simulated clock drives the very same code.

Event streams: every worker numbers its KV events from 0 without gaps (one ``EventSequence`` per
worker, shared/events/seq.py). A gap (or a first event that is not number 0, or a number going
backwards after a worker restart) means the index missed something, so the worker is flagged:
``needs_resync(worker_id)`` turns true, ``on_resync`` is called once, and events keep being
applied and are also buffered (bounded) until the caller fetches the worker's ``kv_dump`` and
hands it to ``replace_worker_blocks``, which replays the buffered events newer than the dump.

Replica sync (``--router-replica-sync``): every add / prefill-done / free is also queued as a small
struct (shared/kv/router_sync.py) for the caller to publish; ``apply_remote`` applies other
routers' changes so every replica counts every request's load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from dynamod.daemon.router.core import native
from dynamod.daemon.router.core.active_sequences import ActiveSequences
from dynamod.daemon.router.core.busy import BusyPolicy
from dynamod.daemon.router.core.config import KvRouterConfig
from dynamod.daemon.router.core.metrics import RouterMetrics, router_metrics
from dynamod.daemon.router.core.pinned_prefixes import PinnedPrefixes
from dynamod.daemon.router.core.scheduler import KvScheduler, Selection
from dynamod.daemon.router.core.wait_queue import WaitQueue
from dynamod.shared.errors import InvalidRequestError, NoInstancesError, OverloadedError
from dynamod.shared.events.seq import Arrival, EventSequences
from dynamod.shared.kv.approx import ApproxKvIndexer
from dynamod.shared.kv.hashing import compute_block_hashes, compute_sequence_hashes
from dynamod.shared.kv.indexer import APPLIED, KvIndexer, OverlapScores, WorkerKey
from dynamod.shared.kv.router_sync import (
    ActiveSequenceEvent,
    SequenceAdded,
    SequenceFreed,
    SequencePrefillDone,
)
from dynamod.shared.protocol.kv_events import RouterEvent
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.routing import REASON_SESSION, CandidateScore, RoutingDecision

if TYPE_CHECKING:
    from dynamod.daemon.router.core.local_choice import LocalPrefillChoice

logger = logging.getLogger(__name__)

RESYNC_BUFFER_EVENTS = 4096  # events kept per worker while its kv_dump is being fetched
SYNC_OUTBOX_MAX = 10_000  # replica-sync changes waiting to be published; oldest dropped beyond

OUTCOME_GAP = "gap"  # applied, but events were missed before it: resync requested
OUTCOME_DUPLICATE = "duplicate"  # an event number seen already: skipped
OUTCOME_IGNORED = "ignored"  # approximate mode: events are not used

_EVENT_TYPE = {"KvStored": "stored", "KvRemoved": "removed", "KvCleared": "cleared"}


class KvRouter:
    def __init__(
        self,
        config: KvRouterConfig,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        router_id: int | None = None,
        registry: CollectorRegistry | None = None,
        metrics: RouterMetrics | None = None,
        on_resync: Callable[[int], None] | None = None,
        core: ModuleType | None = native.core,
    ) -> None:
        """``core``: the compiled KV core for the scheduler's per-candidate loop and the active
        blocks (default: the one in use, daemon/router/core/native.py); None runs both in Python, with
        the same decisions. The index implementation is chosen by ``KvIndexer`` alone."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.config = config.validate()
        self.block_size = block_size
        self.router_id = router_id if router_id is not None else secrets.randbits(63)
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self.indexer = KvIndexer()
        self.approx: ApproxKvIndexer | None = None
        if not config.use_kv_events:
            self.approx = ApproxKvIndexer(
                ttl_s=config.router_ttl_secs,
                max_tree_size=config.router_max_tree_size,
                prune_target_ratio=config.router_prune_target_ratio,
                clock=clock,
                indexer=self.indexer,
            )
        # While the event plane is down, KV events are lost: routed requests are remembered here,
        # as in approximate mode, on top of the index as it stood (``enter_events_outage``).
        self._outage: ApproxKvIndexer | None = None
        # Prefixes pinned by cache_control count as cached on their worker until their TTL.
        self.pins = PinnedPrefixes(clock=clock)
        self.active = ActiveSequences(block_size, ttl_s=config.router_active_sequence_ttl_secs, clock=clock, core=core)
        self.busy = BusyPolicy(
            decode_blocks_threshold=config.active_decode_blocks_threshold,
            prefill_tokens_threshold=config.active_prefill_tokens_threshold,
            metrics_max_age_s=config.router_load_max_age_secs,
            clock=clock,
        )
        self.scheduler = KvScheduler(block_size, self._rng, core=core)
        self.metrics = metrics if metrics is not None else router_metrics(registry)
        self.queue = WaitQueue(
            config.router_queue_size, config.router_queue_timeout_secs,
            priority_jump_s=config.router_priority_jump_secs, on_wait=self.metrics.observe_queue_wait, clock=clock,
        )
        self._event_counters: dict[tuple[str, str], Counter] = {}
        self._workers: list[WorkerKey] = []
        # Per worker; only its last event can arrive twice, so any other id going back is a restart.
        self._sequences: EventSequences[int] = EventSequences(first=0)
        self._resync: set[int] = set()
        self._resync_buffer: dict[int, deque[RouterEvent]] = {}
        self._on_resync = on_resync
        self._outbox: deque[ActiveSequenceEvent] = deque()
        self._outbox_dropped = 0
        self._outbox_ready = asyncio.Event()

    # ------------------------------------------------------------------------------------------
    # Workers and load.

    @property
    def workers(self) -> list[WorkerKey]:
        return list(self._workers)

    def update_workers(self, workers: Iterable[tuple[int, int]]) -> None:
        """The (worker_id, dp_rank) candidates routable now (ready, not draining or sleeping).

        Workers leaving this list keep their index and active requests (a draining worker comes
        back); call ``remove_worker`` when one leaves discovery for good.
        """
        self._workers = list(dict.fromkeys((int(w), int(r)) for w, r in workers))
        self.queue.notify()

    def remove_worker(self, worker_id: int) -> None:
        """Forgets everything about a worker that left discovery."""
        if self.approx is not None:
            self.approx.remove_worker(worker_id)
        else:
            self.indexer.remove_worker(worker_id)
        if self._outage is not None:
            self._outage.remove_worker(worker_id)
        self.pins.remove_worker(worker_id)
        self.active.remove_worker(worker_id)
        self.busy.remove_worker(worker_id)
        self._sequences.forget(worker_id)
        self._resync.discard(worker_id)
        self._resync_buffer.pop(worker_id, None)
        self.update_workers(w for w in self._workers if w[0] != worker_id)
        logger.info("router worker removed worker_id=%016x", worker_id)

    def apply_load(self, m: LoadMetrics) -> None:
        """Load metrics from a worker (``kv_metrics`` topic)."""
        self.busy.update(m)
        self.queue.notify()

    def set_worker_capacity(self, worker: tuple[int, int], total_blocks: int) -> None:
        """A worker's KV capacity in blocks (model card ``total_kv_blocks``), for busy detection
        from the router's own counts when no load metrics are fresh."""
        self.busy.set_capacity(worker, total_blocks)

    # ------------------------------------------------------------------------------------------
    # Event-plane outages.

    @property
    def in_events_outage(self) -> bool:
        return self._outage is not None

    def enter_events_outage(self) -> None:
        """The event plane lost its server: KV events stop arriving (and those sent meanwhile are
        lost). Route in approximate mode on top of the index as it stood: every routed request's
        blocks count as cached on its worker for ``router_ttl_secs``, so a repeated prefix keeps
        going where it went, instead of to wherever a frozen index says."""
        if self.approx is not None or self._outage is not None:
            return  # already approximate
        cfg = self.config
        self._outage = ApproxKvIndexer(
            ttl_s=cfg.router_ttl_secs,
            max_tree_size=cfg.router_max_tree_size,
            prune_target_ratio=cfg.router_prune_target_ratio,
            clock=self._clock,
        )
        logger.warning("router kv events lost: approximate routing until the event plane is back")

    def leave_events_outage(self) -> list[int]:
        """The event plane is back: drop the outage's guesses and re-read every known worker's
        cache (``kv_dump`` through ``on_resync``), since the events sent meanwhile are lost.
        Returns those workers."""
        if self._outage is None:
            return []
        self._outage = None
        workers = sorted({w for w, _ in self._workers} | {k[0] for k in self.indexer.workers()})
        for wid in workers:
            self.request_resync(wid)
        logger.info("router kv events back: resync requested workers=%d", len(workers))
        return workers

    def _remember(self, worker: WorkerKey, local: list[int], seq: list[int]) -> None:
        """Approximate mode (always, or during an outage): the routed blocks count as cached."""
        if self.approx is not None:
            self.approx.record(worker, local, seq)
        if self._outage is not None:
            self._outage.record(worker, local, seq)

    def credit_pin(
        self, worker: WorkerKey, token_ids: Sequence[int], num_tokens: int, ttl_s: float, lora_name: str | None = None
    ) -> None:
        """A request pinning its first ``num_tokens`` tokens for ``ttl_s`` was routed to ``worker``:
        its whole blocks count as cached there until then (pinned_prefixes.py)."""
        n = min(num_tokens, len(token_ids)) // self.block_size * self.block_size
        if n <= 0 or ttl_s <= 0:
            return
        local = compute_block_hashes(token_ids[:n], self.block_size, lora_name)
        self.pins.record(worker, local, compute_sequence_hashes(local), ttl_s)

    # ------------------------------------------------------------------------------------------
    # KV events.

    def apply_event(self, ev: RouterEvent) -> bool:
        """Applies a worker's KV event. Returns True when the worker now needs a resync (its
        ``kv_dump`` read and passed to ``replace_worker_blocks``)."""
        kind = _EVENT_TYPE.get(type(ev.event).__name__, "unknown")
        if self.approx is not None:
            self._count_event(kind, OUTCOME_IGNORED)
            return False
        wid = ev.worker_id
        eid = ev.event_id
        sequence = self._sequences.of(wid)
        last = sequence.last
        # A stream starts at 0: a later first event means history was missed, unless an empty
        # dump just made this event the baseline (``rebase`` in ``replace_worker_blocks``).
        arrival = sequence.observe(eid)
        if arrival is Arrival.DUPLICATE:
            self._count_event(kind, OUTCOME_DUPLICATE)
            return wid in self._resync
        gap = arrival is not Arrival.IN_ORDER  # a gap, or a restarted worker: both need its dump
        if gap:
            logger.warning(
                "kv event gap worker_id=%016x last_event_id=%s event_id=%d arrival=%s",
                wid, last, eid, arrival.value,
            )
            self.request_resync(wid)
        if wid in self._resync:
            self._resync_buffer.setdefault(wid, deque(maxlen=RESYNC_BUFFER_EVENTS)).append(ev)
        outcome = self.indexer.apply_event(ev)
        self._count_event(kind, OUTCOME_GAP if gap and outcome == APPLIED else outcome)
        return wid in self._resync

    def apply_events(self, events: Iterable[RouterEvent]) -> set[int]:
        """Applies a batch; returns the workers that need a resync."""
        need: set[int] = set()
        for ev in events:
            if self.apply_event(ev):
                need.add(ev.worker_id)
        return need

    def needs_resync(self, worker_id: int) -> bool:
        return worker_id in self._resync

    def workers_needing_resync(self) -> set[int]:
        return set(self._resync)

    def request_resync(self, worker_id: int) -> None:
        """Flags a worker for a ``kv_dump`` re-read (gap seen, or a worker newly discovered)."""
        if worker_id in self._resync:
            return
        self._resync.add(worker_id)
        if self._on_resync is not None:
            try:
                self._on_resync(worker_id)
            except Exception:  # the callback belongs to the caller; routing must go on
                logger.exception("router resync callback failed worker_id=%016x", worker_id)

    def replace_worker_blocks(
        self, worker_id: int, events: Iterable[RouterEvent], last_event_id: int | None = None
    ) -> None:
        """Replaces a worker's blocks with its ``kv_dump`` (``KvStored`` events, parents first).

        ``last_event_id``: the last event the dump includes. Workers stamp their dump events with
        it, so by default it is read from them. Events buffered since the resync was requested
        that are newer are replayed on top, and gap detection continues from there. An empty dump
        without an id makes the next event the new baseline.
        """
        dump = [ev for ev in events if ev.worker_id == worker_id]
        if last_event_id is None and dump:
            last_event_id = max(ev.event_id for ev in dump)
        self.indexer.remove_worker(worker_id)
        for ev in dump:
            self.indexer.apply_event(ev)
        buffered = self._resync_buffer.pop(worker_id, ())
        sequence = self._sequences.of(worker_id)
        if last_event_id is None:
            sequence.rebase()
        else:
            newest = last_event_id
            for ev in buffered:
                if ev.event_id > last_event_id:
                    self.indexer.apply_event(ev)
                    newest = max(newest, ev.event_id)
            sequence.resume_after(newest)
        self._resync.discard(worker_id)
        logger.info(
            "router worker resynced worker_id=%016x dump_events=%d blocks=%d last_event_id=%s",
            worker_id,
            len(dump),
            sum(self.indexer.tree_size(k) for k in self.indexer.workers() if k[0] == worker_id),
            last_event_id,
        )

    def dump_index(self) -> list[RouterEvent]:
        """The whole index as events another router can rebuild from (``replace_worker_blocks``
        per worker), stamped, like a worker's ``kv_dump``, with the last event id applied."""
        out = self.indexer.dump_events()
        for ev in out:
            last = self._sequences.last(ev.worker_id)
            ev.event_id = -1 if last is None else last
        return out

    # ------------------------------------------------------------------------------------------
    # Routing.

    def select_worker(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        overlap_weight: float | None = None,
        temperature: float | None = None,
        allowed: Iterable[tuple[int, int]] | None = None,
        track_active: bool = True,
        prompt_hashes: tuple[list[int], list[int]] | None = None,
        pinned: WorkerKey | None = None,
        local_prefill: LocalPrefillChoice | None = None,
    ) -> RoutingDecision:
        """Picks a worker and starts counting the request on it. Raises ``NoInstancesError``
        without candidates and ``OverloadedError`` when all are busy: it never queues (see
        ``select_worker_waiting``), and it does not take turns with requests already queued.

        ``track_active=False`` is Dynamo's prefill router: the decision is counted (metrics,
        approximate-mode cache prediction) but no active blocks are added, so nothing needs
        ``mark_prefill_done`` or ``free`` afterwards; a prefill pool's load comes from its
        workers' own metrics.

        ``prompt_hashes``: the prompt's (local, sequence) block hashes (``hash_tokens``), for a
        caller that has them (a trace replay routes each prompt up to three times); read only.

        ``pinned``: the worker the request's session is bound to (session affinity). It wins,
        with reason ``session``, when it is a candidate and not busy; otherwise the request is
        routed as any other (the caller sees another worker and moves the session).

        ``local_prefill``: the request's prompt is prefilled on the worker picked here
        (conditional disaggregation decided local): candidates are ranked by its predicted time
        (local_choice.py), not by the KV cost."""
        decision = self._route(
            request_id, token_ids, lora_name, overlap_weight, temperature, allowed, register=True, track_active=track_active,
            hashes=None if prompt_hashes is None else [prompt_hashes], pinned=pinned, local_prefill=local_prefill,
        )
        assert decision is not None
        return decision

    def best_worker(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        overlap_weight: float | None = None,
        temperature: float | None = None,
        allowed: Iterable[tuple[int, int]] | None = None,
        prompt_hashes: tuple[list[int], list[int]] | None = None,
        pinned: WorkerKey | None = None,
    ) -> RoutingDecision:
        """The worker ``select_worker`` would pick, without counting the request anywhere."""
        decision = self._route(request_id, token_ids, lora_name, overlap_weight, temperature, allowed, register=False,
                               hashes=None if prompt_hashes is None else [prompt_hashes], pinned=pinned)
        assert decision is not None
        return decision

    async def select_worker_waiting(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        overlap_weight: float | None = None,
        temperature: float | None = None,
        allowed: Iterable[tuple[int, int]] | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        pinned: WorkerKey | None = None,
        prompt_hashes: tuple[list[int], list[int]] | None = None,
        kv_arriving: bool = False,
        local_prefill: LocalPrefillChoice | None = None,
    ) -> RoutingDecision:
        """Like ``select_worker``, but waits in the bounded queue while every candidate is busy
        (higher ``priority`` first, FIFO within one, with aging: wait_queue.py);
        ``OverloadedError`` when the queue is full or the wait times out. ``prompt_hashes``: as
        ``select_worker``'s (a prompt with images is hashed by its caller, with their keys).
        ``kv_arriving``: a decode whose prompt was prefilled remotely; its KV is fetched, so it
        is counted as arriving (``ActiveSequences.add``) until ``mark_prefill_done``.
        ``local_prefill``: as ``select_worker``'s."""
        allowed_list = list(allowed) if allowed is not None else None
        # Hashed once, however often it retries.
        hashes: list[tuple[list[int], list[int]]] = [] if prompt_hashes is None else [prompt_hashes]

        def attempt() -> RoutingDecision | None:
            return self._route(
                request_id,
                token_ids,
                lora_name,
                overlap_weight,
                temperature,
                allowed_list,
                register=True,
                wait_if_busy=True,
                hashes=hashes,
                pinned=pinned,
                kv_arriving=kv_arriving,
                local_prefill=local_prefill,
            )

        return await self.queue.run(attempt, timeout_s=timeout_s, priority=priority)

    def mark_prefill_done(self, request_id: str) -> None:
        """The request's first token arrived."""
        if self.active.mark_prefill_done(request_id):
            self._publish(SequencePrefillDone(router_id=self.router_id, request_id=request_id))
            self.queue.notify()

    def free(self, request_id: str) -> None:
        """The request ended: finished, failed or cancelled."""
        if self.active.free(request_id):
            self._publish(SequenceFreed(router_id=self.router_id, request_id=request_id))
            self.queue.notify()

    def _candidates(self, allowed: Iterable[tuple[int, int]] | None) -> list[WorkerKey]:
        if allowed is None:
            return self._workers
        permitted = {(int(w), int(r)) for w, r in allowed}
        return [w for w in self._workers if w in permitted]

    def _route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        lora_name: str | None,
        overlap_weight: float | None,
        temperature: float | None,
        allowed: Iterable[tuple[int, int]] | None,
        *,
        register: bool,
        track_active: bool = True,
        wait_if_busy: bool = False,
        hashes: list[tuple[list[int], list[int]]] | None = None,
        pinned: WorkerKey | None = None,
        kv_arriving: bool = False,
        local_prefill: LocalPrefillChoice | None = None,
    ) -> RoutingDecision | None:
        weight = self.config.overlap_score_weight if overlap_weight is None else float(overlap_weight)
        temp = self.config.router_temperature if temperature is None else float(temperature)
        if not (math.isfinite(weight) and weight >= 0):
            raise InvalidRequestError(f"overlap weight must be a finite number >= 0, got {overlap_weight}", param="overlap_weight")
        if not (math.isfinite(temp) and temp >= 0):
            raise InvalidRequestError(f"router temperature must be a finite number >= 0, got {temperature}", param="temperature")
        candidates = self._candidates(allowed)
        if not candidates:
            raise NoInstancesError("no routable worker for this request")

        t0 = time.perf_counter()
        if hashes:
            local, seq = hashes[0]
        else:
            local = compute_block_hashes(token_ids, self.block_size, lora_name)
            seq = compute_sequence_hashes(local)
            if hashes is not None:
                hashes.append((local, seq))
        t1 = time.perf_counter()
        if self.approx is not None:
            overlaps = self.approx.find_matches_sequence(seq)
        else:
            overlaps = self.indexer.find_matches_sequence(seq)
            if self._outage is not None:
                overlaps = _best_of(overlaps, self._outage.find_matches_sequence(seq))
        if self.pins:
            pinned_overlaps = self.pins.find_matches_sequence(seq)
            if pinned_overlaps is not None:
                overlaps = _best_of(overlaps, pinned_overlaps)
        t2 = time.perf_counter()

        busy: list[tuple[int, int, str]] = []
        if self.busy.enabled:
            self.active.expire()  # a request never freed must not keep a worker busy forever
            free_workers = []
            for w in candidates:
                why = self.busy.busy_reason(w, self.active)
                if why is None:
                    free_workers.append(w)
                else:
                    busy.append((w[0], w[1], why))
            if not free_workers:
                if wait_if_busy:
                    return None
                raise OverloadedError(f"all {len(candidates)} candidate workers are busy")
            candidates = free_workers
        isl = len(token_ids)
        scores, keys = self.scheduler.score(
            candidates,
            overlaps,
            self.active,
            isl=isl,
            seq_hashes=seq,
            overlap_weight=weight,
            host_weight=self.config.host_cache_hit_weight,
            disk_weight=self.config.disk_cache_hit_weight,
        )
        sel = self._pinned(scores, pinned) if pinned is not None else None
        if sel is None:
            if local_prefill is not None and len(scores) > 1:
                sel = local_prefill.select(scores, keys, isl, self.block_size, self.active, self.busy)
            else:
                sel = self.scheduler.select(scores, keys, temp)
        won = scores[sel.index]
        decision = RoutingDecision(
            request_id=request_id,
            worker_id=won.worker_id,
            dp_rank=won.dp_rank,
            overlap_blocks=won.overlap_blocks,
            request_blocks=len(local),
            isl=isl,
            reason=sel.reason,
            detail=sel.detail,
            overlap_weight=weight,
            temperature=temp,
            candidates=scores,
            busy=busy,
        )
        t3 = time.perf_counter()

        m = self.metrics
        m.hashing_seconds.observe(t1 - t0)
        m.find_matches_seconds.observe(t2 - t1)
        m.scheduling_seconds.observe(t3 - t2)
        if register:
            if track_active:
                self._register(request_id, decision.worker, local, seq, isl, won.overlap_blocks, kv_arriving)
            else:
                self._remember(decision.worker, local, seq)
            m.decisions.labels(sel.reason).inc()
            m.observe_hit(len(local), won.overlap_blocks, won.host_overlap_blocks, won.disk_overlap_blocks)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route request_id=%s worker_id=%016x dp_rank=%d overlap=%d blocks=%d cost=%.3f reason=%s candidates=%d busy=%d",
                request_id,
                won.worker_id,
                won.dp_rank,
                won.overlap_blocks,
                len(local),
                won.cost,
                sel.reason,
                len(scores),
                len(busy),
            )
        return decision

    @staticmethod
    def _pinned(scores: list[CandidateScore], pinned: WorkerKey) -> Selection | None:
        """The session's worker as the winner, if it is among the scored (not busy) candidates."""
        for i, c in enumerate(scores):
            if c.worker_id == pinned[0] and c.dp_rank == pinned[1]:
                lowest = min(x.cost for x in scores)
                return Selection(i, scores, REASON_SESSION, f"session affinity: its worker, cost {c.cost:.3f} (lowest {lowest:.3f})")
        return None

    def _register(
        self, request_id: str, worker: WorkerKey, local: list[int], seq: list[int], isl: int, overlap: int,
        kv_arriving: bool = False,
    ) -> None:
        self.active.add(request_id, worker, seq, isl, isl - overlap * self.block_size, arriving=kv_arriving)
        self._remember(worker, local, seq)
        self._publish(
            SequenceAdded(
                router_id=self.router_id,
                request_id=request_id,
                worker_id=worker[0],
                dp_rank=worker[1],
                isl=isl,
                overlap_blocks=overlap,
                local_hashes=local,
                arriving=kv_arriving,
            )
        )

    # ------------------------------------------------------------------------------------------
    # Replica sync.

    def apply_remote(self, ev: ActiveSequenceEvent) -> None:
        """Applies another router replica's active-sequence change (our own are ignored)."""
        if ev.router_id == self.router_id:
            return
        key = (ev.router_id, ev.request_id)
        if isinstance(ev, SequenceAdded):
            seq = compute_sequence_hashes(ev.local_hashes)
            worker = (ev.worker_id, ev.dp_rank)
            self.active.add(key, worker, seq, ev.isl, ev.isl - ev.overlap_blocks * self.block_size, arriving=ev.arriving)
            self._remember(worker, ev.local_hashes, seq)
        elif isinstance(ev, SequencePrefillDone):
            self.active.mark_prefill_done(key)
        elif isinstance(ev, SequenceFreed):
            self.active.free(key)
        self.queue.notify()

    def take_sync_events(self) -> list[ActiveSequenceEvent]:
        """Our active-sequence changes not yet handed out (empty unless replica sync is on)."""
        out = list(self._outbox)
        self._outbox.clear()
        self._outbox_ready.clear()
        return out

    async def next_sync_events(self) -> list[ActiveSequenceEvent]:
        """Waits for at least one change to publish, then takes them all."""
        while not self._outbox:
            await self._outbox_ready.wait()
        return self.take_sync_events()

    def _publish(self, ev: ActiveSequenceEvent) -> None:
        if not self.config.router_replica_sync:
            return
        if len(self._outbox) >= SYNC_OUTBOX_MAX:
            self._outbox.popleft()
            self._outbox_dropped += 1
            if self._outbox_dropped % 1000 == 1:
                logger.warning("router replica-sync outbox full dropped=%d", self._outbox_dropped)
        self._outbox.append(ev)
        self._outbox_ready.set()

    # ------------------------------------------------------------------------------------------

    def _count_event(self, kind: str, outcome: str) -> None:
        counter = self._event_counters.get((kind, outcome))
        if counter is None:
            counter = self._event_counters[(kind, outcome)] = self.metrics.kv_events.labels(kind, outcome)
        counter.inc()


def _best_of(known: OverlapScores, guessed: OverlapScores) -> OverlapScores:
    """Per worker, the longer of the cached prefix the index knows and the one routing implies
    (a worker whose prefix was lengthened by the guess loses its lower-tier continuation, which
    was measured from the shorter prefix)."""
    scores = dict(known.scores)
    lower = known.lower
    for worker, blocks in guessed.scores.items():
        if blocks > scores.get(worker, 0):
            scores[worker] = blocks
            if worker in lower:
                lower = {w: c for w, c in lower.items() if w != worker}
    return OverlapScores(scores, known.tree_sizes, lower)
