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
from collections.abc import Callable, Sequence
from fractions import Fraction
from functools import lru_cache
from types import ModuleType

from dynamod.daemon.router.core import native
from dynamod.daemon.router.core.active_sequences import ActiveSequences
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
    """Scores candidates and picks one. The per-candidate loop and the lowest-key search run in
    the compiled KV core when it is built (daemon/router/core/_native/schedcore.c), else in Python
    (``_score_python``, the reference); both give the same scores, keys and choices."""

    def __init__(self, block_size: int, rng: random.Random, *, core: ModuleType | None = native.core) -> None:
        """``core``: the compiled KV core (default: the one in use, see shared/kv/native.py); None
        forces the Python loops, e.g. to compare the two."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.rng = rng
        self._score_core: Callable[..., tuple[list[CandidateScore], list[int]] | None] | None = getattr(
            core, "score_candidates", None
        )
        self._lowest_core: Callable[[list[int]], tuple[int, int, int] | None] | None = getattr(core, "lowest_keys", None)

    @property
    def implementation(self) -> str:
        """``native`` or ``python``: where the per-candidate loop runs."""
        return "native" if self._score_core is not None else "python"

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

        Keys are ``cost * b * block_size * scale``, where ``a/b`` is the overlap weight and
        ``scale`` the common denominator of the tier weights (1 when no worker holds prompt blocks
        below its device): the same factor for every candidate, so comparisons and ties are
        those of the costs. Only the few workers with an active request starting like this
        prompt can share active blocks with it, so only they are searched (``shared_prefixes``)."""
        bs = self.block_size
        a, b = weight_ratio(overlap_weight)
        lower = overlaps.lower
        scale = 1
        host_units = disk_units = 0
        if lower:
            hn, hd = weight_ratio(host_weight)
            dn, dd = weight_ratio(disk_weight)
            scale = math.lcm(hd, dd)
            host_units = hn * (scale // hd) * bs  # credited prefill tokens x scale, per host block
            disk_units = dn * (scale // dd) * bs
        terms = active.load_terms()
        shared = active.shared_prefixes(seq_hashes)
        if self._score_core is not None:
            out = self._score_core(
                candidates, overlaps.scores, overlaps.tree_sizes, lower, terms, shared, CandidateScore,
                isl, bs, a, b * bs * scale, scale, host_units, disk_units,
            )
            if out is not None:  # None: a value beyond exact int64 / double arithmetic
                return out
        if lower:
            return self._score_tiered(candidates, overlaps, terms, shared, isl, a, b, scale, host_units, disk_units)
        return self._score_python(candidates, overlaps, terms, shared, isl, a, b)

    def _score_python(
        self,
        candidates: Sequence[WorkerKey],
        overlaps: OverlapScores,
        terms: dict[WorkerKey, tuple[int, int]],
        shared: dict[WorkerKey, int],
        isl: int,
        a: int,
        b: int,
    ) -> tuple[list[CandidateScore], list[int]]:
        """The reference loop when no worker holds prompt blocks below its device. Keys are
        ``cost * b * block_size``."""
        bs = self.block_size
        decode_scale = b * bs
        request_blocks = -(-isl // bs)
        overlap_of = overlaps.scores.get
        tree_size_of = overlaps.tree_sizes.get
        load_of = terms.get
        shared_get = shared.get
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
                active_blocks, load_prefill = load
                prefill_tokens = load_prefill + uncached
                reused = shared_get(worker, 0)
                decode_blocks = active_blocks + request_blocks - (reused if reused > overlap else overlap)
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
        terms: dict[WorkerKey, tuple[int, int]],
        shared: dict[WorkerKey, int],
        isl: int,
        a: int,
        b: int,
        scale: int,
        host_units: int,
        disk_units: int,
    ) -> tuple[list[CandidateScore], list[int]]:
        """``_score_python`` when some worker holds prompt blocks below its device (kept apart so
        the common case stays lean). Keys are ``cost * b * block_size * scale``."""
        bs = self.block_size
        decode_scale = b * bs * scale
        request_blocks = -(-isl // bs)
        overlap_of = overlaps.scores.get
        lower_of = overlaps.lower.get
        tree_size_of = overlaps.tree_sizes.get
        scores: list[CandidateScore] = []
        keys: list[int] = []
        for worker in candidates:
            overlap = overlap_of(worker, 0)
            uncached = max(isl - overlap * bs, 0)
            host, disk = lower_of(worker, (0, 0))[:2]
            load = terms.get(worker)
            if load is None:
                prefill_tokens = uncached
                decode_blocks = request_blocks - overlap
            else:
                active_blocks, load_prefill = load
                prefill_tokens = load_prefill + uncached
                reused = shared.get(worker, 0)
                decode_blocks = active_blocks + request_blocks - (reused if reused > overlap else overlap)
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
        # No sort, which at a thousand candidates cost a tenth of a decision: one pass in the
        # compiled core, else min/count/index (each in C too). Ties and the runner-up are taken
        # in candidate order, as a stable sort would.
        lowest = self._lowest_core(keys) if self._lowest_core is not None and type(keys) is list else None
        if lowest is not None:
            i, ties, second = lowest
            best = keys[i]
        else:
            best = min(keys)
            ties = keys.count(best)
            i = keys.index(best)
            if ties == 1:
                second = keys.index(min(keys[:i] + keys[i + 1 :]))
        if ties == 1:
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
