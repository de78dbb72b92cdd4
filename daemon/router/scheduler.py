"""Worker selection: ``cost(w) = overlap_weight * prefill_blocks(w) + decode_blocks(w)``.

- ``prefill_blocks(w) = (w's active prefill tokens + prompt tokens not cached on w) / block_size``:
  the prefill work w would face, in blocks, kept fractional (a 40-token remainder of block 16 is
  2.5 blocks, not 3).
- ``decode_blocks(w) = w's active blocks + prompt blocks new to w``: the KV blocks w would have to
  find room for. A prompt block is not new to w when a request active on w uses it or w holds it
  in its prefix cache: either way w allocates nothing for it. (Counting cached blocks as new, as
  a reading of Dynamo's scheduler does, charges the caching worker for memory it already has and
  pushes repeated prefixes away from it: on the Mooncake trace replay this one change raises the
  hit rate from 0.50 to 0.53 at 1x and from 0.38 to 0.46 at 4x, and lowers mean and p99 TTFT.)

KV tiers: a worker whose device prefix of ``g`` blocks continues in its host memory (``h`` more
blocks) and then on its disk (``d`` more; shared/kv/index_tiers.py) does not have to recompute
those blocks, only to onboard them. They are credited as ``host_weight * h + disk_weight * d``
blocks off its prefill (Dynamo's ``--router-host-cache-hit-weight`` 0.75 and
``--router-disk-cache-hit-weight`` 0.25): ``prefill_blocks(w) = (w's active prefill tokens +
prompt tokens not on its device) / block_size - credit``. A block counts once, in its fastest tier.
``decode_blocks`` is unchanged: onboarded blocks need device blocks like new ones.

Exact arithmetic: the weight is turned into a fraction ``a/b`` (its shortest decimal, so 0.1 is
1/10, not the binary double) and every cost is compared as the integer
``a * prefill_tokens + b * block_size * decode_blocks`` = ``cost * b * block_size``. Ties are
therefore real ties, never floating-point accidents; floats appear only in what is reported and
in the sampling weights.

Temperature 0 picks the lowest cost; ties go to the smallest cached tree (spread the cache), then
to a random pick. Temperature T > 0 samples with ``p ∝ exp(-(c - c_min) / ((c_max - c_min) T))``,
uniform when all costs are equal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache

from dynamod.daemon.router.active_sequences import ActiveSequences
from dynamod.shared.kv.indexer import OverlapScores, WorkerKey
from dynamod.shared.protocol.routing import (
    REASON_LOWEST_COST,
    REASON_ONLY_CANDIDATE,
    REASON_SAMPLED,
    REASON_TIE_RANDOM,
    REASON_TIE_SMALLEST_TREE,
    CandidateScore,
)


@lru_cache(maxsize=256)
def weight_ratio(weight: float) -> tuple[int, int]:
    """``weight`` as an exact fraction (numerator, denominator) of its shortest decimal form."""
    if weight < 0 or not math.isfinite(weight):
        raise ValueError(f"overlap weight must be finite and >= 0, got {weight}")
    frac = Fraction(repr(float(weight))).limit_denominator(1_000_000)
    return frac.numerator, frac.denominator


class Selection:
    """The scheduler's answer: the winning candidate's index, the scores, and why."""

    __slots__ = ("index", "scores", "reason", "detail")

    def __init__(self, index: int, scores: list[CandidateScore], reason: str, detail: str) -> None:
        self.index = index
        self.scores = scores
        self.reason = reason
        self.detail = detail


class KvScheduler:
    def __init__(self, block_size: int, rng: random.Random) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.rng = rng

    def score(
        self,
        candidates: Sequence[WorkerKey],
        overlaps: OverlapScores,
        active: ActiveSequences,
        *,
        isl: int,
        seq_hashes: Sequence[int],
        overlap_weight: float,
        host_weight: float = 0.0,
        disk_weight: float = 0.0,
    ) -> tuple[list[CandidateScore], list[int]]:
        """Each candidate's cost terms, plus the exact integer cost keys used for comparison.

        One pass per candidate, kept lean because fleets have a thousand of them: only the few
        workers with an active request starting like this prompt can share active blocks with
        it, so they are looked up once (``workers_sharing_first_block``) instead of probing
        every worker's active blocks."""
        bs = self.block_size
        a, b = weight_ratio(overlap_weight)
        lower = overlaps.lower
        if lower:
            # Tier credit in exact integers too: every key is scaled by the weights' common
            # denominator, the same for all candidates, so comparisons and ties are unchanged.
            hn, hd = weight_ratio(host_weight)
            dn, dd = weight_ratio(disk_weight)
            scale = math.lcm(hd, dd)
            host_units = hn * (scale // hd) * bs  # credited prefill tokens x scale, per host block
            disk_units = dn * (scale // dd) * bs
            return self._score_tiered(
                candidates, overlaps, active, isl, seq_hashes, a, b, scale, host_units, disk_units
            )
        decode_scale = b * bs
        request_blocks = -(-isl // bs)
        overlap_of = overlaps.scores.get
        tree_size_of = overlaps.tree_sizes.get
        loads = active.loads()
        load_of = loads.get
        shared_of: dict[WorkerKey, int] = {}
        if seq_hashes:
            for worker in active.workers_sharing_first_block(seq_hashes[0]):
                load = load_of(worker)
                if load is not None:
                    shared_of[worker] = load.shared_prefix(seq_hashes)
        shared_get = shared_of.get
        scores: list[CandidateScore] = []
        keys: list[int] = []
        add_key = keys.append
        add_score = scores.append
        score = CandidateScore
        for worker in candidates:
            overlap = overlap_of(worker, 0)
            uncached = isl - overlap * bs
            if uncached < 0:
                uncached = 0
            load = load_of(worker)
            if load is None:
                prefill_tokens = uncached
                decode_blocks = request_blocks - overlap
            else:
                prefill_tokens = load.prefill_tokens + uncached
                shared = shared_get(worker, 0)
                decode_blocks = (
                    len(load.block_refs) + load.partial_blocks + request_blocks - (shared if shared > overlap else overlap)
                )
            key = a * prefill_tokens + decode_scale * decode_blocks
            add_key(key)
            add_score(
                score(
                    worker[0],
                    worker[1],
                    overlap,
                    prefill_tokens,
                    prefill_tokens / bs,
                    decode_blocks,
                    key / decode_scale,
                    tree_size_of(worker, 0),
                )
            )
        return scores, keys

    def _score_tiered(
        self,
        candidates: Sequence[WorkerKey],
        overlaps: OverlapScores,
        active: ActiveSequences,
        isl: int,
        seq_hashes: Sequence[int],
        a: int,
        b: int,
        scale: int,
        host_units: int,
        disk_units: int,
    ) -> tuple[list[CandidateScore], list[int]]:
        """``score`` when some worker holds prompt blocks below its device (kept apart so the
        common case stays lean). Keys are ``cost * b * block_size * scale``."""
        bs = self.block_size
        decode_scale = b * bs * scale
        request_blocks = -(-isl // bs)
        overlap_of = overlaps.scores.get
        lower_of = overlaps.lower.get
        tree_size_of = overlaps.tree_sizes.get
        loads = active.loads()
        shared_of: dict[WorkerKey, int] = {}
        if seq_hashes:
            for worker in active.workers_sharing_first_block(seq_hashes[0]):
                load = loads.get(worker)
                if load is not None:
                    shared_of[worker] = load.shared_prefix(seq_hashes)
        scores: list[CandidateScore] = []
        keys: list[int] = []
        for worker in candidates:
            overlap = overlap_of(worker, 0)
            uncached = max(isl - overlap * bs, 0)
            host, disk = lower_of(worker, (0, 0))[:2]
            load = loads.get(worker)
            if load is None:
                prefill_tokens = uncached
                decode_blocks = request_blocks - overlap
            else:
                prefill_tokens = load.prefill_tokens + uncached
                shared = shared_of.get(worker, 0)
                decode_blocks = (
                    len(load.block_refs) + load.partial_blocks + request_blocks - (shared if shared > overlap else overlap)
                )
            credited = host * host_units + disk * disk_units  # tokens x scale
            prefill_scaled = prefill_tokens * scale - credited
            key = a * prefill_scaled + decode_scale * decode_blocks
            keys.append(key)
            scores.append(
                CandidateScore(
                    worker[0],
                    worker[1],
                    overlap,
                    prefill_tokens,
                    prefill_scaled / (bs * scale),
                    decode_blocks,
                    key / decode_scale,
                    tree_size_of(worker, 0),
                    None,
                    host,
                    disk,
                    credited / (bs * scale),
                )
            )
        return scores, keys

    def select(self, scores: list[CandidateScore], keys: list[int], temperature: float) -> Selection:
        """Picks a winner among scored candidates (at least one)."""
        if not scores:
            raise ValueError("no candidates to select from")
        if len(scores) == 1:
            return Selection(0, scores, REASON_ONLY_CANDIDATE, f"only candidate, cost {scores[0].cost:.3f}")
        if temperature > 0:
            return self._sample(scores, keys, temperature)
        # min/count/index run in C: no sort, which at a thousand candidates cost a tenth of a
        # decision. Ties and the runner-up are taken in candidate order, as a stable sort would.
        best = min(keys)
        if keys.count(best) == 1:
            i = keys.index(best)
            others = keys[:i] + keys[i + 1 :]
            second = keys.index(min(others))
            return Selection(
                i,
                scores,
                REASON_LOWEST_COST,
                f"lowest cost {scores[i].cost:.3f}; next {scores[second].cost:.3f} "
                f"(worker {scores[second].worker_id} dp {scores[second].dp_rank})",
            )
        tied = [i for i, key in enumerate(keys) if key == best]
        smallest = min(scores[i].tree_size for i in tied)
        smallest_tied = [i for i in tied if scores[i].tree_size == smallest]
        if len(smallest_tied) == 1:
            i = smallest_tied[0]
            return Selection(
                i,
                scores,
                REASON_TIE_SMALLEST_TREE,
                f"{len(tied)} tied at cost {scores[i].cost:.3f}; smallest cached tree ({smallest} blocks)",
            )
        i = self.rng.choice(smallest_tied)
        return Selection(
            i,
            scores,
            REASON_TIE_RANDOM,
            f"{len(smallest_tied)} tied at cost {scores[i].cost:.3f} and tree size {smallest}; random pick",
        )

    def _sample(self, scores: list[CandidateScore], keys: list[int], temperature: float) -> Selection:
        lo = min(keys)
        span = max(keys) - lo
        if span == 0:
            weights = [1.0] * len(keys)
        else:
            scale = span * temperature
            weights = [math.exp(-(k - lo) / scale) for k in keys]
        total = math.fsum(weights)
        for s, w in zip(scores, weights, strict=True):
            s.probability = w / total
        x = self.rng.random() * total
        acc = 0.0
        i = len(weights) - 1
        for j, w in enumerate(weights):
            acc += w
            if x < acc:
                i = j
                break
        return Selection(
            i,
            scores,
            REASON_SAMPLED,
            f"sampled at temperature {temperature:g} with p={scores[i].probability:.3f}; "
            f"cost {scores[i].cost:.3f}, lowest {min(s.cost for s in scores):.3f}",
        )
