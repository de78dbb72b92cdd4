"""How many workers a demand needs: the capacity model both planners size from.

From the performance profile (``dynamod profile``) and the SLA targets, per replica:

- prefill: ``thpt(isl)`` uncached prompt tokens/s at full load. A prefill worker is driven at most
  to the utilisation at which queueing keeps TTFT within target: one prompt takes
  ``S = ttft(isl)``; an M/D/1 queue at utilisation ``rho`` waits ``rho S / (2 (1 - rho))``, so
  ``rho_ttft = 2W / (S + 2W)`` with ``W = ttft_target - S``, capped at ``MAX_UTILISATION``.
- decode: the highest output tokens/s whose ITL, corrected, stays within target (the profile's
  ``best_throughput_per_gpu``).
- agg: one worker does both by time sharing, and every engine step that carries a prefill chunk
  is a long gap for the requests decoding beside it (``agg_prefill_share``: the share of time
  prefill may take while the requests whose mean ITL passes the target stay within the ITL part
  of the error budget, and at most ``rho_ttft``). ITL misses in agg come from that
  interference, and more workers (each prefilling less) cure them.
  Replicas: ``max(prefill / (thpt x cap), prefill / thpt + decode / decode_thpt)``.

Demand is uncached prompt tokens/s (``rate x isl x (1 - prefix hit rate)``) and output tokens/s.
A backlog (prompt tokens queued now) adds the rate that clears it within the TTFT target.
Everything here is pure arithmetic on the profile: no clock, no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynamod.daemon.perf.profile import PerfProfile
from dynamod.daemon.planner.policy import binomial_request_miss, exponential_osl_classes

MAX_UTILISATION = 0.9  # never plan a pool busier than this: a queue near 1.0 has no bound
MIN_AGG_PREFILL_SHARE = 0.05
DEFAULT_CHUNK_TOKENS = 8192  # vLLM's max_num_batched_tokens; the profile's settings say better
DEFAULT_ATTAINMENT = 0.98  # share of requests within both TTFT and ITL the planner aims at (--sla-attainment)
# The capacity model plans for this share of the error budget (1 - attainment): the rest is the
# margin for what the model does not see (bursts inside a window, a mix that changed).
MISS_AIM = 2.0 / 3.0


def ceil_replicas(x: float) -> int:
    """ceil that forgives float noise (3.0000000001 is 3), and 0 for nothing."""
    return max(0, math.ceil(x - 1e-9))


@dataclass(frozen=True, slots=True)
class Demand:
    """What the pools are asked to do, per second, and what is queued now."""

    request_rate: float
    isl: float
    osl: float
    hit_rate: float = 0.0  # share of prompt tokens the prefix cache serves
    backlog_tokens: float = 0.0  # prompt tokens queued now, not yet computed
    # (output tokens, weight) classes of the output lengths (``policy.osl_classes``), when a
    # frontend's histogram measured them; none: exponential around ``osl``.
    osl_classes: tuple[tuple[float, float], ...] = ()

    @property
    def prefill_tokens_s(self) -> float:
        return self.request_rate * self.isl * (1.0 - min(max(self.hit_rate, 0.0), 0.95))

    @property
    def decode_tokens_s(self) -> float:
        return self.request_rate * self.osl


@dataclass(frozen=True, slots=True)
class Sized:
    """Replicas per pool for one demand, and the model's numbers behind them."""

    prefill: int  # disagg prefill pool (0 in agg)
    decode: int  # disagg decode pool, or the agg pool
    prefill_load: float  # fractional replicas the prefill work needs at the planned utilisation
    decode_load: float
    prefill_thpt: float  # uncached prompt tokens/s one replica computes
    decode_thpt: float  # output tokens/s one replica decodes within the ITL target
    prefill_cap: float  # the utilisation planned for prefill work
    backlog_s: float  # seconds the current replicas need to clear the queued prompt tokens

    def as_inputs(self) -> dict[str, float]:
        return {"prefill_load": round(self.prefill_load, 3), "decode_load": round(self.decode_load, 3),
                "prefill_thpt": round(self.prefill_thpt, 1), "decode_thpt": round(self.decode_thpt, 1),
                "prefill_cap": round(self.prefill_cap, 3), "backlog_s": round(self.backlog_s, 2)}


class CapacityModel:
    """See the module docstring."""

    def __init__(self, profile: PerfProfile, *, mode: str, ttft_ms: float, itl_ms: float,
                 prefill_gpus: int = 1, decode_gpus: int = 1, attainment: float = DEFAULT_ATTAINMENT) -> None:
        if not 0.0 < attainment < 1.0:
            raise ValueError(f"attainment must be a share in (0, 1), got {attainment}")
        self.profile = profile
        self.attainment = attainment
        self.mode = mode
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.prefill_gpus = prefill_gpus
        self.decode_gpus = decode_gpus
        chunk = profile.settings.get("max_num_batched_tokens", DEFAULT_CHUNK_TOKENS)
        self.chunk_tokens = float(chunk) if isinstance(chunk, int | float) and chunk > 0 else DEFAULT_CHUNK_TOKENS

    # ---- per-replica figures -------------------------------------------------------------------

    def prefill_thpt(self, isl: float) -> float:
        gpus = self.prefill_gpus if self.mode == "disagg" else self.decode_gpus
        return self.profile.prefill.throughput_per_gpu(max(isl, 1.0)) * gpus

    def ttft_utilisation(self, isl: float) -> float:
        """The prefill utilisation at which an M/D/1 queue's wait plus one prompt's compute meets
        the TTFT target."""
        service = self.profile.prefill.ttft(max(isl, 1.0))
        wait = self.ttft_ms - service
        if wait <= 0:
            return MIN_AGG_PREFILL_SHARE  # one prompt alone misses: run as idle as we may
        return min(MAX_UTILISATION, 2 * wait / (service + 2 * wait))

    @property
    def error_budget(self) -> float:
        """The share of requests that may miss the SLA (1 - the attainment aimed at)."""
        return 1.0 - self.attainment

    def agg_prefill_share(self, isl: float, osl: float, d_correction: float = 1.0, *, hit_rate: float = 0.0,
                          osl_classes: tuple[tuple[float, float], ...] = (),
                          decoding_per_share: float = 0.0) -> float:
        """The most of an agg worker's time prefill may take with decodes' ITL in target.

        A decode step lasts ``d``; a step that also carries prefill ``d + c``. At a prefill time
        share ``f`` a step carries prefill with probability ``p = f d / (c (1 - f))``, and a
        request of ``k`` gaps misses its mean ITL ``L`` when more than ``k (L - d) / c`` of them
        do: a binomial tail per output-length class (``osl_classes``, else exponential around
        ``osl``). The share is the largest ``f`` whose expected misses stay within the model's
        part of the error budget (``MISS_AIM x (1 - attainment)``), and at most ``rho_ttft``.

        Both step lengths grow with ``f``: ``c`` is the profile's time for the prompts one step
        batches -- a typical prompt's uncached tokens times one plus the M/D/1 queue
        ``u^2 / (2 (1 - u))`` waiting beside it, at most one token budget, where ``u = f (1 + d /
        c1)`` is the engine's busy share (a step carrying one prompt, ``c1``, pays its decode
        step too) -- and ``d`` the
        decode step at the requests decoding on the worker, ``decoding_per_share x f x ITL`` (a
        worker at share ``f`` takes that part of the traffic; Little's law at the mean ITL the
        requests see, ``d / (1 - f)``).
        (Taking ``f`` itself as the chance of a long gap, with every step a full budget, is
        about 3x too conservative; a long request alone would allow ``1 - d / L``.)"""
        top = min(MAX_UTILISATION, self.ttft_utilisation(isl))
        uncached = max(isl * (1.0 - min(max(hit_rate, 0.0), 0.95)), 1.0)
        context = isl + osl / 2
        corr = max(d_correction, 0.1)
        if self.profile.decode.itl(0.0, context) * corr >= self.itl_ms:
            return MIN_AGG_PREFILL_SHARE  # decode alone misses: prefill as little as we may
        classes = list(osl_classes) or exponential_osl_classes(osl)
        aim = MISS_AIM * self.error_budget
        c_one = self.profile.prefill.ttft(min(uncached, self.chunk_tokens))

        def misses(f: float) -> float:
            # Little's law at the ITL the requests see (d / (1 - f) on average), from the target's
            # concurrency down: two steps settle it
            d = self.profile.decode.itl_at_concurrency(decoding_per_share * f * self.itl_ms / 1000.0, context) * corr
            for _ in range(2):
                itl_s = min(d / (1.0 - f), self.itl_ms) / 1000.0
                d = self.profile.decode.itl_at_concurrency(decoding_per_share * f * itl_s, context) * corr
            if d >= self.itl_ms:
                return 1.0
            # the engine's busy share: each step carrying a prompt also pays its decode step
            busy = f * (1.0 + d / c_one) if c_one > 0 else f
            if busy >= 1.0:
                return 1.0
            batch = min(uncached * (1.0 + busy * busy / (2.0 * (1.0 - busy))), self.chunk_tokens)
            c = self.profile.prefill.ttft(batch)
            if c <= 0:
                return 0.0
            return binomial_request_miss(classes, f * d / (c * (1.0 - f)), (self.itl_ms - d) / c)

        lo, hi = MIN_AGG_PREFILL_SHARE, max(MIN_AGG_PREFILL_SHARE, top)
        if misses(hi) <= aim:
            return hi
        if misses(lo) > aim:
            return lo
        for _ in range(20):  # the miss share rises with f: bisect to ~1e-6
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if misses(mid) <= aim else (lo, mid)
        return lo

    def decode_thpt(self, isl: float, osl: float, d_correction: float = 1.0) -> float:
        itl = self.itl_ms / d_correction if d_correction > 0 else self.itl_ms
        thpt, _, _ = self.profile.decode.best_throughput_per_gpu(itl, isl + osl / 2)
        return thpt * self.decode_gpus

    # ---- sizing --------------------------------------------------------------------------------

    def size(self, demand: Demand, *, d_correction: float = 1.0, ready: int = 0, clear_s: float = 0.0) -> Sized:
        """Replicas for ``demand``: the steady rate at the planned utilisation, plus what clears the
        backlog within ``clear_s`` (at least the TTFT target). ``ready`` (the replicas serving
        now) only sets ``backlog_s``."""
        isl, osl = max(demand.isl, 1.0), max(demand.osl, 1.0)
        p_thpt = self.prefill_thpt(isl)
        d_thpt = self.decode_thpt(isl, osl, d_correction)
        clear_s = max(self.ttft_ms / 1000.0, clear_s, 1e-3)
        backlog_rate = demand.backlog_tokens / clear_s
        backlog_s = demand.backlog_tokens / (p_thpt * ready) if ready > 0 else math.inf if demand.backlog_tokens else 0.0
        decode_load = demand.decode_tokens_s / d_thpt
        if self.mode == "agg":
            steady = demand.prefill_tokens_s / p_thpt
            # output tokens/s per unit of prefill share: a worker prefilling a share f of its
            # time takes f / steady of the traffic (times the ITL: the requests decoding on it)
            per_share = demand.request_rate * osl / steady if steady > 0 else 0.0
            cap = self.agg_prefill_share(isl, osl, d_correction, hit_rate=demand.hit_rate,
                                         osl_classes=demand.osl_classes, decoding_per_share=per_share)
            prefill_load = max(steady / cap, steady + decode_load)
            # A backlog is cleared at full speed: each replica prefills flat out for a while.
            total = max(prefill_load, steady + backlog_rate / p_thpt + decode_load)
            return Sized(0, ceil_replicas(total), prefill_load, decode_load, p_thpt, d_thpt, cap, backlog_s)
        cap = self.ttft_utilisation(isl)
        prefill_load = demand.prefill_tokens_s / (p_thpt * cap)
        prefill_total = max(prefill_load, (demand.prefill_tokens_s + backlog_rate) / p_thpt)
        return Sized(ceil_replicas(prefill_total), ceil_replicas(decode_load), prefill_load, decode_load,
                     p_thpt, d_thpt, cap, backlog_s)
