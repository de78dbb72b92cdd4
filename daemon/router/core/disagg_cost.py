"""Predicted time to first token for a local and a remote prefill: the cost-based policy's model.

Compute times come from one place per deployment, never from constants of their own:

- ``MockerCompute``: the mocker's timing model itself (daemon/perf/mocker_timing.py), chunked
  by its ``max_num_batched_tokens`` and divided by its ``speedup_ratio`` (trace replay, where the
  cores are mockers with a known config);
- ``ProfileCompute``: a ``dynamod profile`` performance profile (daemon/perf/profile.py,
  the planner's tables: prefill TTFT against input length, decode ITL against KV usage); the live
  frontend and router use the one shipped for the mocker unless the policy config names another.

The KV transfer is the blocks the decode worker lacks, ``kv_bytes_per_token`` each token, over the
configured bandwidth, plus a per-transfer latency: configured, or measured live from the decode
worker's reported median transfer time (``TransferEstimate.measured``).

``predict`` is pure: the caller gathers the state (queues, caches, running decodes) and gets a
``DisaggCost`` whose fields explain every term; ``DisaggCost.local_cost_ms <= remote_cost_ms``
means local (ties go local: a local prefill moves nothing).

Interference: a local prefill stretches the steps of every decode running on that worker by the
prompt's per-token compute (``stall_ms``), so the local side is charged that stall times the
running decodes, at least one: a decode worker with nothing running now is one the next decode
routed there will wait on, and the decode pool's time is what disaggregation exists to protect.
Summed over the decodes it delays, the policy minimises the total latency added, not only the new
request's; ``interference_weight`` scales it (0: the new request's TTFT alone).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dynamod.daemon.perf.mocker_timing import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    decode_time_ms,
    prefill_time_ms,
)
from dynamod.daemon.perf.profile import PerfProfile
from dynamod.shared.protocol.routing import DisaggCost
from dynamod.shared.stats import percentile

DEFAULT_TRANSFER_BANDWIDTH_GB_S = 25.0  # one RDMA NIC's worth (200 Gb/s), as the replay's default
DEFAULT_TRANSFER_LATENCY_MS = 1.0
DEFAULT_INTERFERENCE_WEIGHT = 1.0
BANDWIDTH_MEASURED = "measured"  # the latency comes from the decode worker's transfers
BANDWIDTH_CONFIG = "config"
# When a prompt's KV blocks start moving to the decode worker (``TransferEstimate.overlap``).
OVERLAP_NONE = "none"  # all of them when the prefill ends
OVERLAP_CHUNK = "chunk"  # each prefill chunk's blocks when that chunk is computed
OVERLAP_LAYER = "layer"  # each layer's share of a chunk's blocks as that layer is computed
OVERLAPS = (OVERLAP_NONE, OVERLAP_CHUNK, OVERLAP_LAYER)
DEFAULT_NUM_LAYERS = 32  # Llama-3-8B, as DEFAULT_KV_BYTES_PER_TOKEN


class ComputeModel(Protocol):
    """How long an engine computes: ``prefill_ms(n)`` for ``n`` uncached prompt tokens (chunked
    as the engine chunks them), ``steps(n)`` the engine steps that takes, ``decode_step_ms(p)``
    one decode step at KV occupancy ``p``."""

    name: str

    def prefill_ms(self, tokens: int) -> float: ...

    def steps(self, tokens: int) -> int: ...

    def chunk_tokens(self) -> int: ...

    def decode_step_ms(self, kv_fraction: float) -> float: ...


def _chunks(tokens: int, chunk: int) -> int:
    return 0 if tokens <= 0 else -(-tokens // chunk)


@dataclass(frozen=True, slots=True)
class MockerCompute:
    """The mocker's own timing: each chunk of ``max_num_batched_tokens`` is one step."""

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    speedup_ratio: float = 1.0
    name: str = "mocker"

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        full, rest = divmod(tokens, self.max_num_batched_tokens)
        return (full * prefill_time_ms(self.max_num_batched_tokens) + prefill_time_ms(rest)) / self.speedup_ratio

    def steps(self, tokens: int) -> int:
        return _chunks(tokens, self.max_num_batched_tokens)

    def chunk_tokens(self) -> int:
        return self.max_num_batched_tokens

    def decode_step_ms(self, kv_fraction: float) -> float:
        return decode_time_ms(kv_fraction) / self.speedup_ratio


@dataclass(frozen=True, slots=True)
class ProfileCompute:
    """A performance profile's tables: prefill TTFT at the prompt length (the profile measured
    whole prefills, chunking included), decode ITL at the KV usage, for the shortest context
    profiled (short contexts are where a decode step is cheapest, so interference is not
    understated)."""

    profile: PerfProfile
    name: str = "profile"

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        table = self.profile.prefill
        if tokens >= table.isl[0]:
            return table.ttft(tokens)
        # Below the smallest profiled length the table is flat: scale its per-token slope down
        # to the fixed part, so 16 tokens do not cost what 128 do.
        fixed = max(table.ttft_ms[0] - (table.ttft_ms[1] - table.ttft_ms[0]) / (table.isl[1] - table.isl[0]) * table.isl[0], 0.0) \
            if len(table.isl) > 1 else table.ttft_ms[0]
        return fixed + (table.ttft_ms[0] - fixed) * tokens / table.isl[0]

    def steps(self, tokens: int) -> int:
        return _chunks(tokens, self.chunk_tokens())

    def chunk_tokens(self) -> int:
        return int(self.profile.settings.get("max_num_batched_tokens") or DEFAULT_MAX_NUM_BATCHED_TOKENS)

    def decode_step_ms(self, kv_fraction: float) -> float:
        decode = self.profile.decode
        return decode.itl(min(max(kv_fraction, 0.0), 1.0), decode.rows[0].context_length)


@dataclass(frozen=True, slots=True)
class TransferEstimate:
    """Time to move ``n`` tokens' KV blocks: ``latency_ms + n * kv_bytes_per_token / bandwidth``.
    ``source`` says whether the bandwidth was measured on completed transfers or configured; a
    measured figure already includes each transfer's fixed cost (latency 0).

    ``overlap`` (``OVERLAPS``): ``chunk``, the blocks of each prefill chunk start moving as that
    chunk is computed (the decode worker is chosen when the prefill is dispatched); ``layer``,
    each of a chunk's ``num_layers`` layers moves as it is computed; either way only the part of
    the transfer still running when the prefill ends delays the first token (``exposed_ms``).
    ``none``: the whole transfer starts after the prefill."""

    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    bandwidth_gb_s: float = DEFAULT_TRANSFER_BANDWIDTH_GB_S
    latency_ms: float = DEFAULT_TRANSFER_LATENCY_MS
    source: str = BANDWIDTH_CONFIG
    overlap: str = OVERLAP_NONE
    num_layers: int = DEFAULT_NUM_LAYERS

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAPS:
            raise ValueError(f"transfer overlap must be one of {', '.join(OVERLAPS)}, got {self.overlap!r}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {self.num_layers}")

    def bytes_for(self, tokens: int) -> int:
        return max(tokens, 0) * self.kv_bytes_per_token

    def time_ms(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_ms + nbytes / (self.bandwidth_gb_s * 1e9) * 1000.0

    def exposed_ms(self, compute: ComputeModel, isl: int, decode_cached: int, prefill_cached: int) -> float:
        """The transfer time after the prefill's last chunk ends, for the ``isl - decode_cached``
        tokens the decode worker lacks (``time_ms`` of their bytes without overlap).

        Overlapped: the prefix the prefill worker caches (``prefill_cached`` tokens) is ready at
        once; each chunk of the rest is ready when it is computed (``compute.prefill_ms`` of the
        tokens so far), or layer by layer across its compute (``layer``: its first layer's share
        after ``1/num_layers`` of it); the link moves them in order, one at a time, at
        ``bandwidth_gb_s``; the latency (the completion notice) comes once, after the last byte.
        The queue ahead of the prompt on the prefill worker shifts every chunk alike, so it is
        left out."""
        lacking = max(isl - max(decode_cached, 0), 0)
        if self.overlap == OVERLAP_NONE or lacking == 0:
            return self.time_ms(self.bytes_for(lacking))
        per_token_ms = self.kv_bytes_per_token / (self.bandwidth_gb_s * 1e9) * 1000.0
        decode_cached = max(decode_cached, 0)
        ready = min(max(prefill_cached, 0), isl)
        link_ms = max(ready - decode_cached, 0) * per_token_ms  # the cached prefix moves first
        computed_ms = 0.0
        chunk = max(compute.chunk_tokens(), 1)
        layers = self.num_layers if self.overlap == OVERLAP_LAYER else 1
        to_compute = isl - ready
        done = 0
        while done < to_compute:
            start = ready + done
            began_ms = computed_ms
            done = min(done + chunk, to_compute)
            computed_ms = compute.prefill_ms(done)
            moving = ready + done - max(start, decode_cached)
            if moving > 0:
                link_ms = pipelined_end_ms(link_ms, moving * per_token_ms, began_ms, computed_ms, layers)
        return max(link_ms - computed_ms, 0.0) + self.latency_ms

    def measured(self, p50_ms: float, p50_tokens: float) -> TransferEstimate:
        """This estimate with the per-transfer latency a decode worker measured: its median
        transfer time less what the configured bandwidth explains of the median transfer sent its
        way (floored at the configured latency); itself when either figure is missing.

        Only the latency is taken from the measurement: a worker reports a window's median time
        and cumulative bytes, not size and time per transfer, so a per-token speed cannot be told
        from a fixed cost (dividing a short transfer's time by its tokens made a 5k-token
        transfer look seconds long). What the median transfer took is certain, and a transfer
        takes at least that much beyond its bytes."""
        if not (p50_ms > 0 and math.isfinite(p50_ms)) or not p50_tokens >= 1:
            return self
        explained = self.bytes_for(int(p50_tokens)) / (self.bandwidth_gb_s * 1e9) * 1000.0
        latency = max(p50_ms - explained, self.latency_ms)
        return TransferEstimate(self.kv_bytes_per_token, self.bandwidth_gb_s, latency, BANDWIDTH_MEASURED, self.overlap,
                                self.num_layers)


def pipelined_end_ms(link_free_ms: float, link_ms: float, began_ms: float, computed_ms: float, layers: int) -> float:
    """When the last byte of one computed piece lands: ``link_ms`` of bytes, computed from
    ``began_ms`` to ``computed_ms``, in ``layers`` equal parts each ready when its layer is (1: all
    at ``computed_ms``), behind a link busy until ``link_free_ms``. The parts' readiness grows
    linearly, so the last byte lands after the link's queue, after the first part plus the whole
    piece, or after the last part plus its own share, whichever is latest."""
    first_ready = began_ms + (computed_ms - began_ms) / layers if layers > 1 else computed_ms
    return max(link_free_ms + link_ms, first_ready + link_ms, computed_ms + link_ms / layers)


class RecentSamples:
    """The last ``size`` samples of a figure, for a median or a low quantile."""

    def __init__(self, size: int = 64) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        self._values.append(value)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1, ``shared/stats.py``'s definition) of the samples; 0 without any."""
        return percentile(self._values, q)


@dataclass(frozen=True, slots=True)
class CostState:
    """What one decision weighs (tokens unless named otherwise)."""

    isl: int
    decode_cached_tokens: int  # prompt prefix cached on the chosen decode worker
    decode_queued_tokens: int  # prefill work already waiting on that decode worker
    running_decodes: int  # requests decoding there, whose steps a local prefill stretches
    decode_kv_fraction: float  # its KV occupancy (decode step time)
    prefill_cached_tokens: int  # prompt prefix cached on the chosen prefill worker
    prefill_queued_tokens: int  # prefill work already waiting on that prefill worker
    local_overhead_ms: float = 0.0  # the local path's measured extra cost (live, ``PathOverhead``), 0 in replay
    remote_overhead_ms: float = 0.0  # the remote path's measured extra cost (live, ``PathOverhead``), 0 in replay


def predict(
    state: CostState, compute: ComputeModel, transfer: TransferEstimate, interference_weight: float = DEFAULT_INTERFERENCE_WEIGHT
) -> DisaggCost:
    """Both predictions, every term kept for the explanation."""
    isl = state.isl
    step = compute.decode_step_ms(state.decode_kv_fraction)
    # Local: the decode worker's queued prefill work, then this prompt (``queued_then_own``), each
    # step also carrying the decodes running there; each of those decodes waits out the prompt's
    # compute.
    local_tokens = max(isl - min(state.decode_cached_tokens, isl), 0)
    q_dec = max(state.decode_queued_tokens, 0)
    local_compute, local_steps = queued_then_own(compute, q_dec, local_tokens)
    riding = local_steps * step if state.running_decodes > 0 else 0.0
    local_overhead = max(state.local_overhead_ms, 0.0)
    local_ttft = local_compute + riding + local_overhead
    interference = stall_ms(compute, local_tokens) * max(state.running_decodes, 1)
    local_cost = local_ttft + interference_weight * interference
    # Remote: the prefill worker's queue, then the prompt it does not cache (``queued_then_own``,
    # as the local side); the blocks the decode worker lacks travel; the decode worker then takes
    # it in its next step, which carries a chunk of its own queued prefill work if it has some.
    remote_tokens = max(isl - min(state.prefill_cached_tokens, isl), 0)
    q_pre = max(state.prefill_queued_tokens, 0)
    own = compute.prefill_ms(remote_tokens)
    remote_compute, _ = queued_then_own(compute, q_pre, remote_tokens)
    nbytes = transfer.bytes_for(local_tokens)
    transfer_ms = transfer.time_ms(nbytes)
    exposed_ms = transfer.exposed_ms(compute, isl, min(state.decode_cached_tokens, isl), state.prefill_cached_tokens)
    first_chunk = min(q_dec, _chunk_of(compute, q_dec))
    decode_start = step + compute.prefill_ms(first_chunk)
    overhead = max(state.remote_overhead_ms, 0.0)
    remote_ttft = remote_compute + exposed_ms + decode_start + overhead
    return DisaggCost(
        local_prefill_tokens=local_tokens,
        local_queued_tokens=q_dec,
        running_decodes=state.running_decodes,
        local_compute_ms=round(local_compute, 3),
        local_overhead_ms=round(local_overhead, 3),
        local_ttft_ms=round(local_ttft, 3),
        local_interference_ms=round(interference, 3),
        local_cost_ms=round(local_cost, 3),
        remote_prefill_tokens=remote_tokens,
        remote_queued_tokens=q_pre,
        remote_queue_ms=round(remote_compute - own, 3),
        remote_compute_ms=round(remote_compute, 3),
        transfer_bytes=nbytes,
        bandwidth_gb_s=round(transfer.bandwidth_gb_s, 3),
        bandwidth_source=transfer.source,
        transfer_ms=round(transfer_ms, 3),
        transfer_exposed_ms=round(exposed_ms, 3),
        transfer_overlap=transfer.overlap,
        decode_start_ms=round(decode_start, 3),
        remote_overhead_ms=round(overhead, 3),
        remote_ttft_ms=round(remote_ttft, 3),
        remote_cost_ms=round(remote_ttft, 3),
        compute_model=compute.name,
    )


def stall_ms(compute: ComputeModel, tokens: int) -> float:
    """What prefilling ``tokens`` on a decode worker adds to the steps of a decode running there:
    the prompt's per-token compute. The per-step fixed part (``prefill_ms(1)`` per step) is left
    out: a decode worker pays a fixed cost on every step it takes, prefill or not, and counting it
    here would charge a few-token prompt as much as a step of real work."""
    if tokens <= 0:
        return 0.0
    return max(compute.prefill_ms(tokens) - compute.steps(tokens) * compute.prefill_ms(1), 0.0)


def local_on_worker_ms(
    compute: ComputeModel,
    *,
    tokens: int,
    queued_tokens: int,
    running_decodes: int,
    kv_fraction: float,
    interference_weight: float = DEFAULT_INTERFERENCE_WEIGHT,
) -> float:
    """What prefilling ``tokens`` (uncached there) on one decode worker costs, in ms, to compare
    decode workers for a prompt already decided local (``local_choice.LocalPrefillChoice``): its
    predicted time to first token plus ``interference_weight`` times the stall it puts on the
    decodes running there (as ``predict``'s local side)."""
    step = compute.decode_step_ms(kv_fraction)
    running = max(running_decodes, 0)
    own = max(tokens, 0)
    ttft, steps = queued_then_own(compute, max(queued_tokens, 0), own)
    return ttft + (steps * step if running > 0 else 0.0) + interference_weight * stall_ms(compute, own) * max(running, 1)


def queued_then_own(compute: ComputeModel, queued_tokens: int, tokens: int) -> tuple[float, int]:
    """A prompt's prefill compute on a worker with ``queued_tokens`` of prefill work queued there
    (routed, no first token yet), and the engine steps it takes: the queued work in steps of its
    own, then the prompt's ``tokens``.

    Not one batch: the router counts a prompt as queued from the moment it routes it until its
    first token, and an engine takes a waiting prompt at its next step, so what the router sees
    queued is mostly a prefill step already under way, which a new prompt cannot join. (Measured
    live: a short prompt that lands on a decode worker which got another one within 30 ms takes
    44-50 ms to its first token, against 30 ms alone, i.e. one prefill step more, not the 1.3 ms
    that batching the two predicts; two dozen chat streams starting together on three decode
    workers took 59-66 ms against 19-26 predicted as one batch, and the path's learned overhead
    then priced every local prompt of the next wave 33 ms higher.) The same model prices both
    paths and ranks decode workers, so neither path is charged for a queue the other is not."""
    queued = max(queued_tokens, 0)
    own = max(tokens, 0)
    return compute.prefill_ms(queued) + compute.prefill_ms(own), compute.steps(queued) + compute.steps(own)


def _chunk_of(compute: ComputeModel, tokens: int) -> int:
    """The first step's share of ``tokens`` queued prefill tokens (one engine chunk)."""
    steps = compute.steps(tokens)
    return tokens if steps <= 1 else -(-tokens // steps)


@dataclass(frozen=True, slots=True)
class PathView:
    """One path as a decision sees it (``PathOverhead.view``): its learned extra cost, whether
    that is measured, and whether it may take this request (measured, or an exploration slot free)."""

    ms: float
    measured: bool
    may_explore: bool


class PathOverhead:
    """What one path (local or remote) costs beyond its prediction, learned live from each
    request's measured time to first token (prefill stage start to the first token the caller
    receives) minus the path's predicted TTFT; the caller adds it to that path's prediction.

    Measured end to end, not only the remote prefill stage: on a real host the remote path also
    pays two request hops (prefill worker, then decode worker), the decode worker's KV pull and
    its wait for the next engine step after the pull, which no compute model knows, and the local
    path pays its own hop and step alignment. Both paths are learned the same way, so neither is
    charged for the host while the other is not.

    Kept per prompt size class (a factor of 4 in prompt tokens): the fixed cost of a remote hop
    dominates a short prompt's residual and vanishes in a long one's, whose residual is mostly the
    queue prediction's error; one pool for all sizes let long prompts' samples decide what a short
    prompt's remote prefill costs. The estimate is the class's ``QUANTILE`` over its fresh samples
    (``max_age_s``), floored at 0; with fewer than ``MIN_SAMPLES`` fresh ones it is 0. Samples
    age out so that a class the policy stopped sending one way is tried that way again (the
    optimistic 0) instead of being judged for ever on a burst of queueing it once saw.

    That optimism is bounded: while a class is unmeasured, at most ``MIN_SAMPLES`` requests per
    ``explore_window_s`` may be sent this way on its account (``may_explore``, ``explored``), one
    at a time: the next once the previous one's predicted time to first token has passed; beyond
    them the path counts as being measured and the policy takes the other one. Without the bound a
    burst (two dozen chat streams starting together) all went down an unmeasured remote path,
    queued behind each other there, and made the short prompts' p99; four sent in the same
    millisecond measured each other (64-84 ms against 25 predicted, the first remote requests
    of a run) and still made the top five."""

    # The residual's 90th percentile, not its median: a path's misses are one-sided and heavy (a
    # short prompt sent remote that the prefill worker batches into a long prompt's step waits out
    # that step: 150-190 ms against 46 predicted, live at 1P+3D), and the first-token tail is what
    # the policy must not spend; the median let the many quick remote samples price the path.
    QUANTILE = 0.9
    MIN_SAMPLES = 4

    def __init__(
        self, window: int = 64, max_age_s: float = 60.0, explore_window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window
        self.max_age_s = max_age_s
        self.explore_window_s = explore_window_s
        self._clock = clock
        self._classes: dict[int, deque[tuple[float, float]]] = {}
        # per class: when each unmeasured send began, and when its first token was predicted
        self._explorations: dict[int, deque[tuple[float, float]]] = {}

    def view(self, tokens: int) -> PathView:
        """What one decision reads of this path for a ``tokens``-token prompt, from one pass over
        the class's samples (``ms``, ``measured`` and ``may_explore`` together)."""
        key = self.size_class(tokens)
        fresh = self._fresh(key)
        if len(fresh) >= self.MIN_SAMPLES:
            return PathView(self._quantile(fresh), True, True)
        return PathView(0.0, False, self._explore_slot(key))

    def measured(self, tokens: int) -> bool:
        """Enough fresh samples for prompts of this size."""
        return len(self._fresh(self.size_class(tokens))) >= self.MIN_SAMPLES

    def may_explore(self, tokens: int) -> bool:
        """The path may be chosen for a prompt of this size: it is measured, or fewer than
        ``MIN_SAMPLES`` unmeasured sends began within ``explore_window_s`` and the last one's
        predicted first token is due."""
        return self.measured(tokens) or self._explore_slot(self.size_class(tokens))

    def _explore_slot(self, key: int) -> bool:
        """An unmeasured class may take one more exploring request now."""
        began = self._explorations.get(key)
        if not began:
            return True
        now = self._clock()
        oldest = now - self.explore_window_s
        while began and began[0][0] < oldest:
            began.popleft()
        return len(began) < self.MIN_SAMPLES and (not began or now >= began[-1][1])

    def explored(self, tokens: int, predicted_ms: float = 0.0) -> None:
        """A request of this size was sent this way while the class was unmeasured, with its time
        to first token predicted at ``predicted_ms``."""
        if self.measured(tokens):
            return
        key = self.size_class(tokens)
        began = self._explorations.get(key)
        if began is None:
            began = self._explorations[key] = deque(maxlen=self.MIN_SAMPLES)
        now = self._clock()
        due = now + max(predicted_ms, 0.0) / 1000.0 if math.isfinite(predicted_ms) else now
        began.append((now, due))

    @staticmethod
    def size_class(tokens: int) -> int:
        """Prompts within a factor of 4 of each other share a class."""
        return max(tokens, 1).bit_length() // 2

    def samples(self, tokens: int) -> int:
        """Fresh samples in the class of a ``tokens``-token prompt."""
        return len(self._fresh(self.size_class(tokens)))

    def ms(self, tokens: int) -> float:
        """The path's extra cost for a ``tokens``-token prompt (0 until enough is known)."""
        fresh = self._fresh(self.size_class(tokens))
        return self._quantile(fresh) if len(fresh) >= self.MIN_SAMPLES else 0.0

    def _quantile(self, fresh: list[float]) -> float:
        ordered = sorted(fresh)
        return max(ordered[min(len(ordered) - 1, int(self.QUANTILE * (len(ordered) - 1) + 0.5))], 0.0)

    def observe(self, tokens: int, measured_ms: float, predicted_ms: float) -> None:
        """One request's measured TTFT on this path against the prediction made for it (without
        this overhead)."""
        if not math.isfinite(measured_ms) or not math.isfinite(predicted_ms):
            return
        key = self.size_class(tokens)
        samples = self._classes.get(key)
        if samples is None:
            samples = self._classes[key] = deque(maxlen=self._window)
        samples.append((self._clock(), measured_ms - predicted_ms))

    def _fresh(self, key: int) -> list[float]:
        samples = self._classes.get(key)
        if not samples:
            return []
        oldest = self._clock() - self.max_age_s
        while samples and samples[0][0] < oldest:
            samples.popleft()
        return [gap for _, gap in samples]
