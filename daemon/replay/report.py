"""Summaries of a replay: percentiles and the figures every replay prints, agg or disaggregated.

Kept apart from the event loop so that agg and disaggregated runs are measured by the very same
code: a difference in their figures is a difference in the simulated system, not in the counting.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynamod.shared.stats import percentile_of_sorted


@dataclass(slots=True)
class RequestStats:
    """What the client of one request saw, plus where and how it was served.

    ``token_times`` are the simulated times (ms) of the tokens the client received, so
    ``token_times[0] - arrival_ms`` is the TTFT and consecutive differences are the ITLs.
    ``cached_tokens`` counts prompt tokens whose prefill compute was saved by a prefix cache (on
    the prefill worker for a remote prefill, on the decode worker for a local one).
    """

    arrival_ms: float
    prompt_tokens: int
    worker: int = -1  # the worker that streamed the tokens (the decode worker when disaggregated)
    token_times: list[float] = field(default_factory=list)
    finish_ms: float = -1.0
    cached_tokens: int = 0
    output_tokens: int = 0
    # Disaggregated runs only.
    prefill_worker: int = -1
    remote: bool = False
    reason: str = ""
    prefill_done_ms: float = -1.0
    transfer_bytes: int = 0
    transfer_ms: float = 0.0  # the transfer's own time: its bytes over the link plus the latency
    exposed_transfer_ms: float = 0.0  # prefill end to the decode worker's admission (all of it without overlap)


P50, P90, P99, P999 = ("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)


def summary(values: Iterable[float], *qs: tuple[str, float]) -> dict[str, float]:
    """``{"mean": ..., "p50": ...}`` rounded to microseconds (the figures are milliseconds)."""
    ordered = sorted(values)
    res = {"mean": round(sum(ordered) / len(ordered), 3) if ordered else 0.0}
    for name, q in qs:
        res[name] = round(percentile_of_sorted(ordered, q), 3)
    return res


def client_figures(done: Sequence[RequestStats]) -> dict[str, object]:
    """TTFT, ITL, end-to-end latency, throughput and prefix-cache hit rate over finished requests."""
    ttft = [s.token_times[0] - s.arrival_ms for s in done if s.token_times]
    itl: list[float] = []
    for s in done:  # each request's gaps, later token minus earlier (a C loop: millions of tokens)
        times = s.token_times
        itl.extend(map(operator.sub, itertools.islice(times, 1, None), times))
    e2e = [s.finish_ms - s.arrival_ms for s in done]
    sim_s = sim_seconds(done)
    prompt_total = sum(s.prompt_tokens for s in done)
    prefilled = sum(s.prompt_tokens - s.cached_tokens for s in done)
    out_tokens = sum(s.output_tokens for s in done)
    return {
        "completed": len(done),
        "ttft_ms": summary(ttft, P50, P90, P99),
        "itl_ms": summary(itl, P50, P90, P99, P999),
        "e2e_ms": summary(e2e, P50, P99),
        "requests_per_s": round(len(done) / sim_s, 3) if sim_s else 0.0,
        "output_tokens_per_s": round(out_tokens / sim_s, 1) if sim_s else 0.0,
        "cache_hit_rate": round(1.0 - prefilled / prompt_total, 4) if prompt_total else 0.0,
    }


def sim_seconds(done: Sequence[RequestStats]) -> float:
    """Simulated span from the first arrival to the last finish, in seconds."""
    if not done:
        return 0.0
    return (max(s.finish_ms for s in done) - min(s.arrival_ms for s in done)) / 1000.0


@dataclass(slots=True)
class StepLog:
    """Engine steps of one pool: how long its cores computed, and how decode steps fared.

    ``decode_step_ms`` holds the duration of every step that advanced at least one decoding
    request: a step that also prefilled is longer, and every running stream waits for it. That
    stall is what disaggregation removes, so its tail (and the share of decode steps that carried
    a prefill) is reported beside the per-token ITL.

    ``busy_ms`` is the exact sum of every step's duration (``math.fsum``): a replay may record the
    steps of different cores in any order (a stretch of plain decode steps at once), and a plain
    running sum would then depend on that order in its last bits.
    """

    decode_step_ms: list[float] = field(default_factory=list)
    other_step_ms: list[float] = field(default_factory=list)  # steps that decoded nothing
    decode_steps_with_prefill: int = 0

    @property
    def busy_ms(self) -> float:
        return math.fsum(itertools.chain(self.decode_step_ms, self.other_step_ms))

    def record(self, duration_ms: float, num_decode_reqs: int, num_prefill_tokens: int) -> None:
        if num_decode_reqs:
            self.decode_step_ms.append(duration_ms)
            if num_prefill_tokens:
                self.decode_steps_with_prefill += 1
        else:
            self.other_step_ms.append(duration_ms)

    def record_plain_decode_steps(self, duration_ms: float, count: int) -> None:
        """``count`` decode steps of ``duration_ms`` each that prefilled nothing."""
        self.decode_step_ms.extend(itertools.repeat(duration_ms, count))

    def decode_figures(self) -> dict[str, float]:
        res = summary(self.decode_step_ms, P50, P99)
        n = len(self.decode_step_ms)
        res["with_prefill_frac"] = round(self.decode_steps_with_prefill / n, 4) if n else 0.0
        return res


def busy_fraction(log: StepLog, workers: int, sim_s: float) -> float:
    """Share of the pool's core-time spent computing over the replayed span."""
    if workers <= 0 or sim_s <= 0:
        return 0.0
    return round(log.busy_ms / (workers * sim_s * 1000.0), 4)


def request_itl_ms(s: RequestStats) -> float | None:
    """A request's mean inter-token latency (what Dynamo's ITL target bounds); None with one token."""
    if len(s.token_times) < 2:
        return None
    return (s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1)


def sla_figures(done: Sequence[RequestStats], ttft_ms: float, itl_ms: float) -> dict[str, float]:
    """SLA attainment: the share of finished requests whose TTFT is within ``ttft_ms`` AND whose
    mean ITL is within ``itl_ms`` (a one-token request is judged on TTFT alone), in percent; and
    each condition's own share, so a miss can be told apart."""
    n = len(done)
    if not n:
        return {"ttft_ms": ttft_ms, "itl_ms": itl_ms, "attainment_pct": 0.0, "ttft_ok_pct": 0.0, "itl_ok_pct": 0.0}
    ttft_ok = itl_ok = both = 0
    for s in done:
        t_ok = bool(s.token_times) and s.token_times[0] - s.arrival_ms <= ttft_ms
        itl = request_itl_ms(s)
        i_ok = itl is None or itl <= itl_ms
        ttft_ok += t_ok
        itl_ok += i_ok
        both += t_ok and i_ok
    return {
        "ttft_ms": ttft_ms,
        "itl_ms": itl_ms,
        "attainment_pct": round(100.0 * both / n, 3),
        "ttft_ok_pct": round(100.0 * ttft_ok / n, 3),
        "itl_ok_pct": round(100.0 * itl_ok / n, 3),
    }
