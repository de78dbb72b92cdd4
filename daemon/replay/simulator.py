"""Discrete-event replay: real router code and real mocker cores on a simulated clock.

Each worker is a ``MockerCore`` (the same scheduler, block manager and timing model the daemon
runs). A worker that has work runs one engine step at a time: the step's duration comes from the
timing model, and its tokens, finished requests and KV events take effect when the step ends. The
router sees exactly what a live router would: KV events as workers publish them, first tokens
(prefill done) and completions, with the simulated clock as its clock. Nothing sleeps, so a
1,000-second trace replays in seconds.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.core import MockerCore, StepOutput
from dynamod.daemon.replay.trace import TraceRequest
from dynamod.daemon.router.config import KvRouterConfig
from dynamod.daemon.router.kv_router import KvRouter
from dynamod.shared.protocol.kv_events import RouterEvent

MODES = ("kv", "round-robin", "random")


@dataclass(slots=True)
class RequestStats:
    arrival_ms: float
    prompt_tokens: int
    worker: int = -1
    token_times: list[float] = field(default_factory=list)
    finish_ms: float = -1.0
    cached_tokens: int = 0
    output_tokens: int = 0


class _Picker:
    """The routing policy: KV-aware (the real KvRouter) or a simple baseline."""

    def __init__(self, mode: str, n_workers: int, block_size: int, clock: Callable[[], float], seed: int,
                 router_config: KvRouterConfig | None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown router mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self._n = n_workers
        self._rr = itertools.count()
        self._rng = random.Random(seed)
        self.router: KvRouter | None = None
        if mode == "kv":
            self.router = KvRouter(router_config or KvRouterConfig(), block_size, clock=clock,
                                   rng=random.Random(seed), registry=None)
            self.router.update_workers([(w, 0) for w in range(n_workers)])
        self._event_ids = [0] * n_workers

    def pick(self, req: TraceRequest) -> int:
        if self.router is not None:
            return self.router.select_worker(str(req.index), req.prompt).worker_id
        if self.mode == "random":
            return self._rng.randrange(self._n)
        return next(self._rr) % self._n

    def on_step(self, worker: int, out: StepOutput) -> None:
        if self.router is None:
            return
        for ev in out.kv_events:
            self.router.apply_event(RouterEvent(worker_id=worker, dp_rank=0, event_id=self._event_ids[worker], event=ev))
            self._event_ids[worker] += 1

    def on_first_token(self, request_id: str) -> None:
        if self.router is not None:
            self.router.mark_prefill_done(request_id)

    def on_finish(self, request_id: str) -> None:
        if self.router is not None:
            self.router.free(request_id)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = (len(sorted_values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def replay(
    requests: list[TraceRequest],
    *,
    workers: int,
    mode: str,
    mocker: MockerConfig,
    router_config: KvRouterConfig | None = None,
    seed: int = 0,
) -> dict:
    """Replays ``requests`` and returns the summary (the ``--json`` object, without wall time)."""
    now = 0.0
    picker = _Picker(mode, workers, mocker.block_size, lambda: now / 1000.0, seed, router_config)
    cores = [MockerCore(mocker) for _ in range(workers)]
    busy = [False] * workers
    stats: dict[str, RequestStats] = {}
    heap: list[tuple[float, int, int, object]] = []  # (time_ms, order, kind, payload)
    order = itertools.count()
    ARRIVAL, STEP_DONE = 0, 1
    for req in requests:
        heapq.heappush(heap, (req.arrival_ms, next(order), ARRIVAL, req))

    def start_step(w: int) -> None:
        out = cores[w].step()
        if out.duration_ms <= 0 and not out.req_ids and not out.finished:
            busy[w] = False  # nothing could run; the next arrival wakes the worker
            return
        busy[w] = True
        heapq.heappush(heap, (now + out.duration_ms, next(order), STEP_DONE, (w, out)))

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == ARRIVAL:
            req: TraceRequest = payload  # type: ignore[assignment]
            rid = str(req.index)
            w = picker.pick(req)
            stats[rid] = RequestStats(arrival_ms=now, prompt_tokens=len(req.prompt), worker=w)
            cores[w].add_request(rid, req.prompt, max_tokens=req.output_length, ignore_eos=True, seed=req.index)
            if not busy[w]:
                start_step(w)
            continue
        w, out = payload  # type: ignore[misc]
        picker.on_step(w, out)
        for rid in out.req_ids:
            st = stats[rid]
            if not st.token_times:
                picker.on_first_token(rid)
            st.token_times.append(now)
        for fin in out.finished:
            st = stats[fin.request_id]
            st.finish_ms = now
            st.cached_tokens = fin.usage.cached_tokens
            st.output_tokens = fin.usage.completion_tokens
            picker.on_finish(fin.request_id)
        if cores[w].has_unfinished_requests():
            start_step(w)
        else:
            busy[w] = False

    done = [s for s in stats.values() if s.finish_ms >= 0]
    ttft = sorted(s.token_times[0] - s.arrival_ms for s in done if s.token_times)
    itl = sorted(b - a for s in done for a, b in itertools.pairwise(s.token_times))
    e2e = sorted(s.finish_ms - s.arrival_ms for s in done)
    sim_s = (max(s.finish_ms for s in done) - min(s.arrival_ms for s in done)) / 1000.0 if done else 0.0
    prompt_total = sum(s.prompt_tokens for s in done)
    prefilled = sum(s.prompt_tokens - s.cached_tokens for s in done)
    out_tokens = sum(s.output_tokens for s in done)

    def summary(values: list[float], *qs: tuple[str, float]) -> dict[str, float]:
        res = {"mean": round(sum(values) / len(values), 3) if values else 0.0}
        for name, q in qs:
            res[name] = round(_percentile(values, q), 3)
        return res

    per_worker = [sum(1 for s in done if s.worker == w) for w in range(workers)]
    return {
        "mode": mode,
        "workers": workers,
        "completed": len(done),
        "ttft_ms": summary(ttft, ("p50", 0.5), ("p90", 0.9), ("p99", 0.99)),
        "itl_ms": summary(itl, ("p50", 0.5)),
        "e2e_ms": summary(e2e, ("p50", 0.5), ("p99", 0.99)),
        "requests_per_s": round(len(done) / sim_s, 3) if sim_s else 0.0,
        "output_tokens_per_s": round(out_tokens / sim_s, 1) if sim_s else 0.0,
        "cache_hit_rate": round(1.0 - prefilled / prompt_total, 4) if prompt_total else 0.0,
        "requests_per_worker": per_worker,
        "sim_s": round(sim_s, 3),
    }
