"""The router's own view of each worker's load: the requests it routed there and has not freed.

Per worker key it counts *active blocks* (the KV blocks those requests occupy, the decode load)
and *active prefill tokens* (prompt tokens routed but not yet prefilled, the prefill load).
Requests sharing a prefix share its blocks on the engine, so blocks are reference-counted by their
chained sequence hash and counted once. A request's trailing partial block is its own.

The scheduler reads two things per decision, both kept ready here rather than rebuilt: each
worker's load terms ``(active blocks, active prefill tokens)`` (``load_terms``, updated on every
add / prefill done / free) and, for the prompt at hand, the blocks it shares with the active
requests of the few workers whose requests start like it (``shared_prefixes``). Each worker's
active blocks live in the compiled core's flat ``ActiveBlocks`` when it is built
(daemon/router/core/_native/schedcore.c), else in its Python twin ``CountedBlocks``; ``DYN_KV_INDEX_IMPL=python``
or ``core=None`` picks the latter. Both count, release and search alike.

Lifecycle, driven by the frontend: ``add`` when routed, ``mark_prefill_done`` at the first token
(its prompt stops counting as prefill load), ``free`` at the end, on error or cancel.

A decode whose prompt was prefilled on another worker is added ``arriving``: its KV is being
fetched (with the transfer overlapped, streamed while the prefill still computes it), so until its
first token it is neither prefill nor decode load there; its blocks join the worker's active
blocks at the first token, when its KV has landed and it decodes. Counting them from the dispatch
made a decode worker look as loaded as a long prompt for the whole remote prefill, and the short
requests routed meanwhile piled onto the other workers. Router replicas count it the same way:
the add they hear says it is arriving, and its first token reaches them as its prefill-done
(shared/kv/router_sync.py). A request never freed (a lost frontend task) is forgotten after
``ttl_s`` so its load does not stick forever.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from types import ModuleType

from dynamod.daemon.router.core import native
from dynamod.shared.kv.indexer import WorkerKey

logger = logging.getLogger(__name__)


class CountedBlocks:
    """One worker's active blocks: sequence hash -> active requests using it; ``len()`` is the
    number of distinct blocks. The pure-Python twin of the compiled ``ActiveBlocks``
    (daemon/router/core/_native/schedcore.c), same methods and results."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: Counter[int] = Counter()  # update() counts a 512-block prompt in C

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, seq_hash: object) -> bool:
        return seq_hash in self._refs

    def count(self, seq_hash: int) -> int:
        return self._refs.get(seq_hash, 0)

    def add(self, seq_hashes: Sequence[int]) -> None:
        """One more active request uses each of these blocks."""
        self._refs.update(seq_hashes)

    def release(self, seq_hashes: Sequence[int]) -> None:
        """One active request fewer uses each of these blocks; blocks nobody uses are dropped
        (a block not active is skipped)."""
        refs = self._refs
        drop = dict.__delitem__  # not Counter's own __delitem__, a Python-level wrapper
        for h in seq_hashes:
            n = refs.get(h)
            if n is None:
                continue
            if n > 1:
                refs[h] = n - 1
            else:
                drop(refs, h)

    def shared_prefix(self, seq_hashes: Sequence[int], hint: int = 0) -> int:
        """How many leading blocks of a prompt are active here.

        The active set is a union of whole prompt chains, so it is prefix-closed along any
        prompt: a binary search finds the boundary in O(log n) lookups. ``hint`` is a guess
        (another worker's answer: many workers' requests end at the same place, a shared system
        prompt say); a right guess is confirmed in two lookups, and the answer never depends on it.
        """
        refs = self._refs
        n = len(seq_hashes)
        lo, hi = 0, n  # the answer lies in [lo, hi]
        if not n or not refs:
            return 0
        if 1 <= hint <= n:
            if seq_hashes[hint - 1] in refs:
                lo = hint
                if hint < n:
                    if seq_hashes[hint] in refs:
                        lo = hint + 1
                    else:
                        return hint
            else:
                hi = hint - 1
        elif seq_hashes[0] not in refs:
            return 0
        else:
            lo = 1
        while lo < hi:  # seq_hashes[:lo] is active; find the largest such lo
            mid = (lo + hi + 1) // 2
            if seq_hashes[mid - 1] in refs:
                lo = mid
            else:
                hi = mid - 1
        return lo


ActiveBlockSet = Callable[[], "CountedBlocks"]
"""Makes an empty per-worker active-block set: ``CountedBlocks`` or the compiled ``ActiveBlocks``."""


class WorkerLoad:
    """What the router believes one worker key is doing."""

    __slots__ = ("blocks", "partial_blocks", "prefill_tokens", "requests")

    def __init__(self, blocks: CountedBlocks) -> None:
        self.blocks = blocks  # active blocks, reference-counted by the requests using them
        self.partial_blocks = 0
        self.prefill_tokens = 0
        self.requests = 0

    @property
    def active_blocks(self) -> int:
        return len(self.blocks) + self.partial_blocks

    def shared_prefix(self, seq_hashes: Sequence[int], hint: int = 0) -> int:
        """How many leading blocks of a prompt are already active here."""
        return self.blocks.shared_prefix(seq_hashes, hint)


_NO_WORKERS: Counter[WorkerKey] = Counter()


class _Sequence:
    __slots__ = ("worker", "seq_hashes", "partial", "prefill_tokens", "prefill_done", "added_at", "arriving")

    def __init__(
        self, worker: WorkerKey, seq_hashes: Sequence[int], partial: int, prefill_tokens: int, added_at: float
    ) -> None:
        self.worker = worker
        self.seq_hashes = seq_hashes
        self.partial = partial
        self.prefill_tokens = prefill_tokens
        self.prefill_done = False
        self.added_at = added_at
        self.arriving = False  # its KV is fetched from a prefill worker: blocks not counted yet


class ActiveSequences:
    """Active requests by id (any hashable: replicas key remote requests by (router, id))."""

    def __init__(
        self,
        block_size: int,
        *,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        core: ModuleType | None = native.core,
    ) -> None:
        """``core``: the compiled KV core, whose ``ActiveBlocks`` holds each worker's active
        blocks (default: the one in use, see shared/kv/native.py); None keeps them in Python."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._new_blocks: ActiveBlockSet = getattr(core, "ActiveBlocks", CountedBlocks)
        self._seqs: OrderedDict[Hashable, _Sequence] = OrderedDict()  # in add order = age order
        self._loads: dict[WorkerKey, WorkerLoad] = {}
        # worker -> (active blocks, active prefill tokens), for workers with active requests:
        # what the scheduler reads for every candidate, kept current instead of derived per decision.
        self._terms: dict[WorkerKey, tuple[int, int]] = {}
        # First block -> active requests starting with it, per worker: the few workers a prompt
        # can share active blocks with, found without probing every worker's blocks (at a
        # thousand workers that probe was a third of a routing decision).
        self._by_first: dict[int, Counter[WorkerKey]] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._seqs

    def worker_of(self, request_id: Hashable) -> WorkerKey | None:
        seq = self._seqs.get(request_id)
        return seq.worker if seq is not None else None

    def load(self, worker: WorkerKey) -> WorkerLoad | None:
        return self._loads.get(worker)

    def loads(self) -> dict[WorkerKey, WorkerLoad]:
        """The per-worker loads, live (read-only by contract; the scheduler's fast path)."""
        return self._loads

    def active_blocks(self, worker: WorkerKey) -> int:
        load = self._loads.get(worker)
        return load.active_blocks if load is not None else 0

    def active_prefill_tokens(self, worker: WorkerKey) -> int:
        load = self._loads.get(worker)
        return load.prefill_tokens if load is not None else 0

    def load_terms(self) -> dict[WorkerKey, tuple[int, int]]:
        """``{worker: (active blocks, active prefill tokens)}`` for workers with active requests
        (live, read-only by contract): the scheduler's per-candidate input."""
        return self._terms

    def shared_prefixes(self, seq_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """For each worker whose active blocks include the prompt's first block, how many of the
        prompt's leading blocks are active there (workers not listed share none)."""
        if not seq_hashes:
            return {}
        sharing = self._by_first.get(seq_hashes[0])
        if not sharing:
            return {}
        loads = self._loads
        out: dict[WorkerKey, int] = {}
        guess = 0  # the previous worker's answer: requests often end where others' do
        for w in sharing:
            guess = out[w] = loads[w].blocks.shared_prefix(seq_hashes, guess)
        return out

    def workers_sharing_first_block(self, first_block: int) -> Counter[WorkerKey]:
        """Workers with an active request whose first block is ``first_block`` (live, read-only):
        only they can share any of a prompt's leading blocks, since a block's sequence hash names
        its whole prefix."""
        return self._by_first.get(first_block) or _NO_WORKERS

    def request_blocks(self, isl: int) -> int:
        """Blocks a prompt of ``isl`` tokens occupies (its partial tail counts as one)."""
        return -(-isl // self.block_size)

    def new_blocks(self, worker: WorkerKey, seq_hashes: Sequence[int], isl: int) -> int:
        """Blocks the prompt would add to ``worker``'s active blocks (not shared with its
        active requests)."""
        total = self.request_blocks(isl)
        load = self._loads.get(worker)
        if load is None:
            return total
        return total - load.shared_prefix(seq_hashes)

    def add(
        self,
        request_id: Hashable,
        worker: WorkerKey,
        seq_hashes: Sequence[int],
        isl: int,
        prefill_tokens: int,
        *,
        arriving: bool = False,
    ) -> None:
        """Starts counting a routed request. ``prefill_tokens``: prompt tokens not cached there.
        ``arriving``: its KV comes from a prefill worker; it counts no prefill tokens, and its
        blocks only from ``mark_prefill_done`` (its first token) on."""
        if request_id in self._seqs:
            logger.info("active sequence re-added request_id=%s; replacing", request_id)
            self.free(request_id)
        now = self._clock()
        self.expire(now)
        partial = 1 if isl % self.block_size else 0
        seq = _Sequence(worker, seq_hashes, partial, 0 if arriving else max(prefill_tokens, 0), now)
        load = self._loads.get(worker)
        if load is None:
            load = self._loads[worker] = WorkerLoad(self._new_blocks())
        if arriving:
            seq.arriving = True
        else:
            self._hold_blocks(load, seq)
        load.prefill_tokens += seq.prefill_tokens
        load.requests += 1
        self._terms[worker] = (len(load.blocks) + load.partial_blocks, load.prefill_tokens)
        self._seqs[request_id] = seq

    def _hold_blocks(self, load: WorkerLoad, seq: _Sequence) -> None:
        """Counts ``seq``'s blocks among its worker's active blocks."""
        seq_hashes = seq.seq_hashes
        load.blocks.add(seq_hashes)
        if seq_hashes:
            sharing = self._by_first.get(seq_hashes[0])
            if sharing is None:
                sharing = self._by_first[seq_hashes[0]] = Counter()
            sharing[seq.worker] += 1
        load.partial_blocks += seq.partial

    def mark_prefill_done(self, request_id: Hashable) -> bool:
        """The first token arrived: the prompt no longer counts as prefill load (an arriving
        request's KV has landed: its blocks count from now on)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.prefill_done:
            return False
        seq.prefill_done = True
        load = self._loads[seq.worker]
        load.prefill_tokens -= seq.prefill_tokens
        if seq.arriving:
            seq.arriving = False
            self._hold_blocks(load, seq)
        self._terms[seq.worker] = (len(load.blocks) + load.partial_blocks, load.prefill_tokens)
        return True

    def arriving(self, request_id: Hashable) -> bool:
        """The request is counted but its KV has not landed yet (``add(arriving=True)``)."""
        seq = self._seqs.get(request_id)
        return seq is not None and seq.arriving

    def free(self, request_id: Hashable) -> bool:
        """The request ended (finished, failed or cancelled)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self._release(seq)
        return True

    def expire(self, now: float | None = None) -> list[Hashable]:
        """Forgets requests older than the TTL (never freed). Returns their ids."""
        if now is None:
            now = self._clock()
        cutoff = now - self.ttl_s
        expired: list[Hashable] = []
        seqs = self._seqs
        while seqs:
            request_id, seq = next(iter(seqs.items()))
            if seq.added_at > cutoff:
                break
            seqs.popitem(last=False)
            self._release(seq)
            expired.append(request_id)
        if expired:
            logger.warning("active sequences expired count=%d ttl_s=%s", len(expired), self.ttl_s)
        return expired

    def remove_worker(self, worker_id: int) -> list[Hashable]:
        """Drops the requests of a worker that left; returns their ids."""
        gone = [rid for rid, seq in self._seqs.items() if seq.worker[0] == worker_id]
        for rid in gone:
            self.free(rid)
        for key in [k for k in self._loads if k[0] == worker_id]:
            del self._loads[key]
            self._terms.pop(key, None)
        return gone

    def _release(self, seq: _Sequence) -> None:
        if seq.arriving:
            self._release_request(seq)  # its blocks were never counted
            return
        if seq.seq_hashes:
            first = seq.seq_hashes[0]
            sharing = self._by_first[first]
            n = sharing[seq.worker] - 1
            if n:
                sharing[seq.worker] = n
            else:
                del sharing[seq.worker]
                if not sharing:
                    del self._by_first[first]
        load = self._loads.get(seq.worker)
        if load is None:
            return
        load.blocks.release(seq.seq_hashes)
        load.partial_blocks -= seq.partial
        self._release_request(seq)

    def _release_request(self, seq: _Sequence) -> None:
        """Stops counting ``seq``'s prefill tokens and the request itself on its worker."""
        load = self._loads.get(seq.worker)
        if load is None:
            return
        if not seq.prefill_done:
            load.prefill_tokens -= seq.prefill_tokens
        load.requests -= 1
        if load.requests == 0:
            del self._loads[seq.worker]
            del self._terms[seq.worker]
        else:
            self._terms[seq.worker] = (len(load.blocks) + load.partial_blocks, load.prefill_tokens)
