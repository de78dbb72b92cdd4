"""Discrete-event replay: real router code and real mocker cores on a simulated clock.

Each worker is a ``MockerCore`` (the same scheduler, block manager and timing model the daemon
runs). A worker that has work runs one engine step at a time: the step's duration comes from the
timing model, and its tokens, finished requests and KV events take effect when the step ends. The
router sees exactly what a live router would: KV events as workers publish them, first tokens
(prefill done) and completions, with the simulated clock as its clock. Nothing sleeps, so a
1,000-second trace replays in seconds.

Aggregated (``replay``): one pool; each worker prefills and decodes its own requests.

Disaggregated (``replay_disagg``): a prefill pool and a decode pool, each with its own router
over its own cores' KV events. Per request, at arrival:

1. the decode worker normal KV routing would choose is estimated (counting nothing), for its
   cached prefix; round-robin / random simply choose it;
2. the prefill worker is chosen (a second KvRouter over the prefill pool; the request counts on
   it only while it prefills, as Dynamo's prefill router keeps no decode-block load);
3. ``disagg_policy.decide`` says remote or local, from the prompt length minus the prefix the
   chosen decode worker caches (its router's overlap) and the chosen prefill core's queued prefill
   tokens (see ``_Pool.prefill_load_tokens``);
4. the decode stage is routed for real, as the frontend does: with no overlap credit for prefix
   blocks when the prompt goes remote (Dynamo's decode stage), with the usual weight when local;
5. remote: the prefill core runs the prompt with ``max_tokens=1``; when that step ends, the KV
   blocks the decode worker lacks travel in ``TransferModel.time_ms``; then the decode core takes
   the request with ``kv_transferred=True`` (its prompt occupies the decode cache at no compute)
   and decodes. Local: the decode core prefills it itself, exactly as in agg mode.

TTFT is what the client sees: arrival to the first token the *decode* worker streams. The token
the prefill worker samples is discarded (Dynamo's frontend takes only the transfer parameters from
the prefill stream, and the decode engine samples the first output token itself), so both modes
count the same ``output_length`` tokens, all from the worker that streams them, and a remote TTFT
includes prefill queueing, prefill compute, the KV transfer and the decode worker's first step.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.core import MockerCore, StepOutput
from dynamod.daemon.replay.report import (
    P50,
    P99,
    RequestStats,
    StepLog,
    busy_fraction,
    client_figures,
    sim_seconds,
    sla_figures,
    summary,
)
from dynamod.daemon.replay.trace import TraceRequest

if TYPE_CHECKING:
    from dynamod.daemon.replay.planner_loop import ReplayPlanner
from dynamod.daemon.router.config import KvRouterConfig
from dynamod.daemon.router.disagg_policy import DisaggInputs, DisaggPolicyConfig, decide
from dynamod.daemon.router.kv_router import KvRouter
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import RouterEvent
from dynamod.shared.protocol.routing import DISAGG_REMOTE, DisaggInfo

MODES = ("kv", "round-robin", "random")

# A Llama-3-8B-like layout: 32 layers x 8 KV heads x 128 head dim x 2 (K and V) x 2 bytes (bf16).
DEFAULT_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
DEFAULT_KV_TRANSFER_BANDWIDTH_GB_S = 25.0  # one RDMA NIC's worth, 200 Gb/s
DEFAULT_KV_TRANSFER_LATENCY_MS = 1.0  # per transfer: metadata round trip and completion notice


@dataclass(frozen=True, slots=True)
class TransferModel:
    """How long moving a prompt's KV blocks from a prefill worker to a decode worker takes.

    Transfers are independent (no link contention): one prefill worker finishes a long prompt
    every few hundred milliseconds while one transfer of it takes tens, so they rarely overlap.
    ``bandwidth_gb_s`` is in 10^9 bytes per second.
    """

    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    bandwidth_gb_s: float = DEFAULT_KV_TRANSFER_BANDWIDTH_GB_S
    latency_ms: float = DEFAULT_KV_TRANSFER_LATENCY_MS

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1:
            raise ConfigError(f"--kv-bytes-per-token must be at least 1, got {self.kv_bytes_per_token}")
        if not self.bandwidth_gb_s > 0:
            raise ConfigError(f"--kv-transfer-bandwidth must be > 0 GB/s, got {self.bandwidth_gb_s}")
        if not self.latency_ms >= 0:
            raise ConfigError(f"--kv-transfer-latency-ms must be >= 0, got {self.latency_ms}")

    def bytes_for(self, blocks: int, block_size: int) -> int:
        """Bytes of ``blocks`` whole KV blocks (a partial last block travels as a whole block)."""
        return max(blocks, 0) * block_size * self.kv_bytes_per_token

    def time_ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / (self.bandwidth_gb_s * 1e9) * 1000.0


class _Picker:
    """The routing policy of one pool: KV-aware (the real KvRouter) or a simple baseline.

    ``keep_index``: also keep a KV index of the pool in round-robin / random mode, so that a
    disaggregated replay can ask how much of a prompt the chosen decode worker caches whatever the
    routing policy (the live system learns it from the same KV events).
    """

    def __init__(self, mode: str, n_workers: int, block_size: int, clock: Callable[[], float], seed: int,
                 router_config: KvRouterConfig | None, *, keep_index: bool = False) -> None:
        if mode not in MODES:
            raise ConfigError(f"unknown router mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self._ids = list(range(n_workers))  # routable workers, in id order
        self._block_size = block_size
        self._rr = itertools.count()
        self._rng = random.Random(seed)
        self.router: KvRouter | None = None
        self._routes = mode == "kv"
        if self._routes or keep_index:
            self.router = KvRouter(router_config or KvRouterConfig(), block_size, clock=clock,
                                   rng=random.Random(seed), registry=None)
            self.router.update_workers([(w, 0) for w in range(n_workers)])
        self._event_ids = [0] * n_workers

    def set_workers(self, ids: list[int]) -> None:
        """The workers new requests may go to (a planner replay: ready, not starting or draining).
        A draining worker keeps its KV index and active requests until ``remove_worker``."""
        self._ids = sorted(ids)
        while len(self._event_ids) <= max(ids, default=-1):
            self._event_ids.append(0)
        if self.router is not None:
            self.router.update_workers([(w, 0) for w in self._ids])

    def remove_worker(self, worker: int) -> None:
        """A stopped worker: the router forgets its blocks and load."""
        if self.router is not None:
            self.router.remove_worker(worker)
        self._ids = [w for w in self._ids if w != worker]

    def pick(self, req: TraceRequest, overlap_weight: float | None = None) -> tuple[int, int | None]:
        """The worker for ``req`` and, in kv mode, the prompt blocks it caches (else None).
        ``overlap_weight`` overrides the router's (0 for a decode stage after remote prefill)."""
        if self._routes:
            assert self.router is not None
            decision = self.router.select_worker(str(req.index), req.prompt, overlap_weight=overlap_weight)
            return decision.worker_id, decision.overlap_blocks
        if self.mode == "random":
            return self._ids[self._rng.randrange(len(self._ids))], None
        return self._ids[next(self._rr) % len(self._ids)], None

    def estimate(self, req: TraceRequest) -> tuple[int, int] | None:
        """kv mode: the worker ``pick`` would choose and the blocks it caches, counting nothing
        (what the live router's decode estimate gives the disaggregation policy); else None."""
        if not self._routes:
            return None
        assert self.router is not None
        decision = self.router.best_worker(str(req.index), req.prompt)
        return decision.worker_id, decision.overlap_blocks

    def cached_blocks(self, worker: int, prompt: list[int]) -> int:
        """Leading prompt blocks ``worker`` caches now, by the pool's KV index (0 without one)."""
        if self.router is None:
            return 0
        _, seq = hash_tokens(prompt, self._block_size)
        return self.router.indexer.find_matches_sequence(seq).scores.get((worker, 0), 0)

    def on_step(self, worker: int, out: StepOutput) -> None:
        if self.router is None:
            return
        for ev in out.kv_events:
            self.router.apply_event(RouterEvent(worker_id=worker, dp_rank=0, event_id=self._event_ids[worker], event=ev))
            self._event_ids[worker] += 1

    def on_first_token(self, request_id: str) -> None:
        if self._routes:
            assert self.router is not None
            self.router.mark_prefill_done(request_id)

    def on_finish(self, request_id: str) -> None:
        if self._routes:
            assert self.router is not None
            self.router.free(request_id)


# Event kinds. Events at the same instant run in the order they were pushed (the heap's second
# key), which keeps a replay deterministic.
_ARRIVAL, _STEP_DONE, _TRANSFER_DONE, _PLANNER_TICK, _WORKER_READY = 0, 1, 2, 3, 4

# Core lifecycle (planner replays): launched -> STARTING -> READY -> DRAINING -> STOPPED.
STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"


@dataclass(slots=True)
class _Pool:
    """One pool of mocker cores and what their steps cost."""

    name: str
    cores: list[MockerCore]
    busy: list[bool]
    # Prompt tokens each core is computing in its current step. The core's state moves on when
    # the step starts, but a live worker reports that batch as queued until the step ends.
    inflight_prefill: list[int]
    log: StepLog = field(default_factory=StepLog)
    # Lifecycle, for replays with a planner (a static replay keeps every core READY from 0 ms):
    # when each core was launched and stopped (-1: running), and its state.
    state: list[str] = field(default_factory=list)
    launched_ms: list[float] = field(default_factory=list)
    stopped_ms: list[float] = field(default_factory=list)
    # Requests routed to a core that have not reached it yet (a KV transfer in flight): a
    # draining decode core must wait for them too.
    incoming: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, name: str, n: int, mocker: MockerConfig) -> _Pool:
        return cls(name, [MockerCore(mocker) for _ in range(n)], [False] * n, [0] * n,
                   state=[READY] * n, launched_ms=[0.0] * n, stopped_ms=[-1.0] * n, incoming=[0] * n)

    def ids(self, state: str) -> list[int]:
        return [w for w, st in enumerate(self.state) if st == state]

    def launch(self, mocker: MockerConfig, now_ms: float) -> int:
        """A new core, STARTING: it takes no work until the planner loop marks it READY."""
        self.cores.append(MockerCore(mocker))
        self.busy.append(False)
        self.inflight_prefill.append(0)
        self.state.append(STARTING)
        self.launched_ms.append(now_ms)
        self.stopped_ms.append(-1.0)
        self.incoming.append(0)
        return len(self.cores) - 1

    def idle(self, w: int) -> bool:
        return not self.busy[w] and not self.incoming[w] and not self.cores[w].has_unfinished_requests()

    def worker_seconds(self, end_ms: float) -> float:
        """Core-seconds paid for, launch (startup included) to stop or ``end_ms``."""
        total = 0.0
        for start, stop in zip(self.launched_ms, self.stopped_ms, strict=True):
            total += max(0.0, (stop if stop >= 0 else end_ms) - start)
        return total / 1000.0

    def prefill_load_tokens(self, w: int) -> int:
        """The load ``prefill_load`` compares with ``prefill_busy_threshold`` in a replay: prompt
        tokens on core ``w`` not yet computed (waiting requests' whole prompts, running requests'
        unfinished chunks) plus those its current step is computing, before the new request joins.
        The threshold is therefore a token count, the unit of the router's
        ``--active-prefill-tokens-threshold``, to which it defaults."""
        return self.cores[w].load().active_prefill_tokens + self.inflight_prefill[w]


class _Simulation:
    """The event loop shared by agg and disaggregated replays (agg: no policy, no prefill pool)."""

    def __init__(self, *, prefill_workers: int, decode_workers: int, mode: str, mocker: MockerConfig,
                 router_config: KvRouterConfig | None, seed: int, policy: DisaggPolicyConfig | None,
                 transfer: TransferModel, planner: ReplayPlanner | None = None,
                 sla_targets: tuple[float, float] | None = None) -> None:
        self.now = 0.0
        self.sla_targets = sla_targets
        self.planner = planner
        self._to_arrive = 0
        self._open = 0  # arrived, not finished
        self.mocker = mocker
        self.policy = policy
        self.transfer = transfer
        self.router_config = router_config or KvRouterConfig()

        def clock() -> float:
            return self.now / 1000.0

        disagg = policy is not None
        self.decode = _Pool.create("decode" if disagg else "agg", decode_workers, mocker)
        self.prefill = _Pool.create("prefill", prefill_workers, mocker)
        self.decode_picker = _Picker(mode, decode_workers, mocker.block_size, clock, seed, router_config, keep_index=disagg)
        # A different seed: the two pools' tie-breaks must not mirror each other.
        self.prefill_picker = (
            _Picker(mode, prefill_workers, mocker.block_size, clock, seed + 1, router_config) if prefill_workers else None
        )
        self.stats: dict[str, RequestStats] = {}
        self.reasons: dict[str, int] = {}
        self._requests: dict[str, TraceRequest] = {}
        self._heap: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()

    # ---- the loop ------------------------------------------------------------------------------

    def run(self, requests: list[TraceRequest]) -> None:
        for req in requests:
            self._push(req.arrival_ms, _ARRIVAL, req)
        self._to_arrive = len(requests)
        if self.planner is not None:
            self._push(self.planner.interval_ms, _PLANNER_TICK, None)
        heap = self._heap
        while heap:
            self.now, _, kind, payload = heapq.heappop(heap)
            if kind == _ARRIVAL:
                self._to_arrive -= 1
                self._open += 1
                self._arrive(payload)  # type: ignore[arg-type]
            elif kind == _PLANNER_TICK:
                assert self.planner is not None
                if self._to_arrive or self._open:  # the last tick is the one after the last finish
                    self.planner.tick(self)
                    self._push(self.now + self.planner.interval_ms, _PLANNER_TICK, None)
            elif kind == _WORKER_READY:
                pool, w = payload  # type: ignore[misc]
                if pool.state[w] == STARTING:
                    pool.state[w] = READY
                    self.sync_routing(pool)
            elif kind == _STEP_DONE:
                pool, w, out = payload  # type: ignore[misc]
                pool.inflight_prefill[w] = 0
                if pool is self.prefill:
                    self._prefill_step_done(w, out)
                else:
                    self._decode_step_done(w, out)
                if pool.cores[w].has_unfinished_requests():
                    self._start_step(pool, w)
                else:
                    pool.busy[w] = False
                    if pool.state[w] == DRAINING and pool.idle(w):
                        self.stop_core(pool, w)
            else:
                self._transfer_done(payload)  # type: ignore[arg-type]

    # ---- scaling (planner replays) -------------------------------------------------------------

    def picker_of(self, pool: _Pool) -> _Picker | None:
        return self.prefill_picker if pool is self.prefill else self.decode_picker

    def sync_routing(self, pool: _Pool) -> None:
        picker = self.picker_of(pool)
        if picker is not None:
            picker.set_workers(pool.ids(READY))

    def launch_core(self, pool: _Pool, startup_ms: float) -> int:
        w = pool.launch(self.mocker, self.now)
        self._push(self.now + startup_ms, _WORKER_READY, (pool, w))
        return w

    def drain_core(self, pool: _Pool, w: int) -> None:
        """No new work for ``w``; it stops once its in-flight requests are done."""
        if pool.state[w] == STARTING:
            pool.state[w] = STOPPED
            pool.stopped_ms[w] = self.now
            return
        pool.state[w] = DRAINING
        self.sync_routing(pool)
        if pool.idle(w):
            self.stop_core(pool, w)

    def stop_core(self, pool: _Pool, w: int) -> None:
        pool.state[w] = STOPPED
        pool.stopped_ms[w] = self.now
        picker = self.picker_of(pool)
        if picker is not None:
            picker.remove_worker(w)

    def _push(self, at_ms: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (at_ms, next(self._order), kind, payload))

    def _start_step(self, pool: _Pool, w: int) -> None:
        out = pool.cores[w].step()
        if not (out.num_prefill_reqs or out.num_decode_reqs or out.req_ids or out.finished):
            pool.busy[w] = False  # nothing could run; the next request wakes the worker
            return
        # A step may take no time yet make progress: a transferred prompt is admitted chunk by
        # chunk at no compute cost. Its next step then runs at the same instant.
        pool.busy[w] = True
        pool.inflight_prefill[w] = out.num_prefill_tokens
        pool.log.record(out.duration_ms, out.num_decode_reqs, out.num_prefill_tokens)
        self._push(self.now + out.duration_ms, _STEP_DONE, (pool, w, out))

    def _wake(self, pool: _Pool, w: int) -> None:
        if not pool.busy[w]:
            self._start_step(pool, w)

    # ---- requests ------------------------------------------------------------------------------

    def _arrive(self, req: TraceRequest) -> None:
        rid = str(req.index)
        if self.policy is None:
            dw, _ = self.decode_picker.pick(req)
            self.stats[rid] = RequestStats(arrival_ms=self.now, prompt_tokens=len(req.prompt), worker=dw)
            self._start_local(req, rid, dw)
            return
        # As the live frontend: the decode worker normal KV routing would pick (counting nothing)
        # gives the effective ISL; after the decision the decode stage is routed for real, with no
        # overlap credit when the prompt is prefilled remotely. Round-robin and random choose the
        # same worker either way, so they choose once.
        estimate = self.decode_picker.estimate(req)
        chosen = estimate is None
        dw, overlap = self.decode_picker.pick(req) if estimate is None else estimate
        st = self.stats[rid] = RequestStats(arrival_ms=self.now, prompt_tokens=len(req.prompt), worker=dw)
        info, pw = self._decide(req, rid, dw, overlap)
        st.reason = info.reason
        self.reasons[info.reason] = self.reasons.get(info.reason, 0) + 1
        remote = info.mode == DISAGG_REMOTE
        if not chosen:
            dw, _ = self.decode_picker.pick(req, overlap_weight=0.0 if remote else None)
            st.worker = dw
        if not remote:
            self._start_local(req, rid, dw)
            return
        st.remote = True
        st.prefill_worker = pw
        # The decode worker will not compute this prompt: its router stops counting it as prefill
        # load now and keeps only its blocks as decode load.
        self.decode_picker.on_first_token(rid)
        self._requests[rid] = req
        self.prefill.cores[pw].add_request(rid, req.prompt, max_tokens=1, ignore_eos=True, seed=req.index)
        self._wake(self.prefill, pw)

    def _start_local(self, req: TraceRequest, rid: str, dw: int) -> None:
        self.decode.cores[dw].add_request(rid, req.prompt, max_tokens=req.output_length, ignore_eos=True, seed=req.index)
        self._wake(self.decode, dw)

    def _decide(self, req: TraceRequest, rid: str, dw: int, overlap: int | None) -> tuple[DisaggInfo, int]:
        """Remote or local prefill for ``req`` with decode candidate ``dw``; the prefill worker
        (-1 without one). A prefill worker routed to but not used hears at once it will not be."""
        assert self.policy is not None
        bs = self.mocker.block_size
        isl = len(req.prompt)
        if overlap is None:
            overlap = self.decode_picker.cached_blocks(dw, req.prompt)
        decode_load = self.decode.cores[dw].load()
        new_blocks = -(-isl // bs) - overlap
        inputs = DisaggInputs(
            isl=isl,
            decode_cached_tokens=min(overlap * bs, isl),
            prefill_available=self.prefill_picker is not None and bool(self.prefill.ids(READY)),
            prefill_busy_threshold=self.router_config.active_prefill_tokens_threshold,
            decode_kv_fraction=(decode_load.active_blocks + new_blocks) / decode_load.total_blocks,
        )
        pw = -1
        if inputs.prefill_available:
            assert self.prefill_picker is not None
            pw, _ = self.prefill_picker.pick(req)
            inputs = DisaggInputs(
                isl=inputs.isl, decode_cached_tokens=inputs.decode_cached_tokens,
                prefill_load=float(self.prefill.prefill_load_tokens(pw)),
                prefill_busy_threshold=inputs.prefill_busy_threshold,
                decode_kv_fraction=inputs.decode_kv_fraction, prefill_worker_id=pw,
            )
        info = decide(self.policy, inputs)
        if info.mode != DISAGG_REMOTE and self.prefill_picker is not None and pw >= 0:
            self.prefill_picker.on_finish(rid)  # routed there, but it will not prefill there
        return info, pw

    def _prefill_step_done(self, w: int, out: StepOutput) -> None:
        picker = self.prefill_picker
        assert picker is not None
        picker.on_step(w, out)
        bs = self.mocker.block_size
        for fin in out.finished:
            rid = fin.request_id
            picker.on_finish(rid)
            st = self.stats[rid]
            st.prefill_done_ms = self.now
            st.cached_tokens = fin.usage.cached_tokens
            req = self._requests[rid]
            # Only the blocks the decode worker lacks travel; it caches the rest already.
            lacking = -(-len(req.prompt) // bs) - self.decode_picker.cached_blocks(st.worker, req.prompt)
            st.transfer_bytes = self.transfer.bytes_for(lacking, bs)
            st.transfer_ms = self.transfer.time_ms(st.transfer_bytes)
            self.decode.incoming[st.worker] += 1
            self._push(self.now + st.transfer_ms, _TRANSFER_DONE, rid)

    def _transfer_done(self, rid: str) -> None:
        req = self._requests.pop(rid)
        dw = self.stats[rid].worker
        self.decode.incoming[dw] -= 1
        self.decode.cores[dw].add_request(
            rid, req.prompt, max_tokens=req.output_length, ignore_eos=True, seed=req.index, kv_transferred=True
        )
        self._wake(self.decode, dw)

    def _decode_step_done(self, w: int, out: StepOutput) -> None:
        picker = self.decode_picker
        picker.on_step(w, out)
        stats = self.stats
        for rid in out.req_ids:
            st = stats[rid]
            if not st.token_times:
                picker.on_first_token(rid)
            st.token_times.append(self.now)
        for fin in out.finished:
            st = stats[fin.request_id]
            st.finish_ms = self.now
            if not st.remote:
                st.cached_tokens = fin.usage.cached_tokens
            st.output_tokens = fin.usage.completion_tokens
            picker.on_finish(fin.request_id)
            self._open -= 1
            if self.planner is not None:
                self.planner.on_finish(st)

    # ---- figures -------------------------------------------------------------------------------

    def report(self, mode: str) -> dict:
        done = [s for s in self.stats.values() if s.finish_ms >= 0]
        sim_s = sim_seconds(done)
        res: dict[str, object] = {"mode": mode}
        if self.policy is None:
            res["workers"] = len(self.decode.cores)
        else:
            res["topology"] = "disagg"
            res["prefill_workers"] = len(self.prefill.cores)
            res["decode_workers"] = len(self.decode.cores)
            res["policy"] = self.policy.name
        res.update(client_figures(done))
        res["decode_step_ms"] = self.decode.log.decode_figures()
        if self.policy is None:
            res["busy_fraction"] = {"agg": busy_fraction(self.decode.log, len(self.decode.cores), sim_s)}
            res["requests_per_worker"] = [sum(1 for s in done if s.worker == w) for w in range(len(self.decode.cores))]
        else:
            remote = [s for s in done if s.remote]
            res["disagg"] = {
                "remote": sum(1 for s in self.stats.values() if s.remote),
                "local": sum(1 for s in self.stats.values() if not s.remote),
                "reasons": dict(sorted(self.reasons.items())),
                "transfer_bytes_total": sum(s.transfer_bytes for s in remote),
                "transfer_ms": summary((s.transfer_ms for s in remote), P50, P99),
                "remote_prefill_ms": summary((s.prefill_done_ms - s.arrival_ms for s in remote), P50, P99),
            }
            res["busy_fraction"] = {
                "prefill": busy_fraction(self.prefill.log, len(self.prefill.cores), sim_s),
                "decode": busy_fraction(self.decode.log, len(self.decode.cores), sim_s),
            }
            res["requests_per_worker"] = {
                "prefill": [sum(1 for s in remote if s.prefill_worker == w) for w in range(len(self.prefill.cores))],
                "decode": [sum(1 for s in done if s.worker == w) for w in range(len(self.decode.cores))],
            }
        res["sim_s"] = round(sim_s, 3)
        end_ms = max((s.finish_ms for s in done), default=0.0)
        if self.sla_targets is not None:
            res["sla"] = sla_figures(done, *self.sla_targets)
        res["worker_seconds"] = round(self.decode.worker_seconds(end_ms) + self.prefill.worker_seconds(end_ms), 3)
        if self.planner is not None:
            res["planner"] = self.planner.report(self, done, end_ms)
        return res


def replay(
    requests: list[TraceRequest],
    *,
    workers: int,
    mode: str,
    mocker: MockerConfig,
    router_config: KvRouterConfig | None = None,
    seed: int = 0,
    planner: ReplayPlanner | None = None,
    sla_targets: tuple[float, float] | None = None,
) -> dict:
    """Replays ``requests`` on ``workers`` aggregated workers; returns the summary (the ``--json``
    object, without wall time). With ``planner``, ``workers`` is the starting count and the
    planner resizes the pool every interval; ``sla_targets`` (TTFT ms, ITL ms) adds attainment."""
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    sim = _Simulation(prefill_workers=0, decode_workers=workers, mode=mode, mocker=mocker,
                      router_config=router_config, seed=seed, policy=None, transfer=TransferModel(),
                      planner=planner, sla_targets=sla_targets)
    sim.run(requests)
    return sim.report(mode)


def replay_disagg(
    requests: list[TraceRequest],
    *,
    prefill_workers: int,
    decode_workers: int,
    mode: str,
    mocker: MockerConfig,
    policy: DisaggPolicyConfig | None = None,
    transfer: TransferModel | None = None,
    router_config: KvRouterConfig | None = None,
    seed: int = 0,
    planner: ReplayPlanner | None = None,
    sla_targets: tuple[float, float] | None = None,
) -> dict:
    """Replays ``requests`` on a prefill pool and a decode pool; returns the summary.

    ``policy`` None means Dynamo's default: unconditional disaggregation with decode fallback.
    """
    policy = policy or DisaggPolicyConfig()
    if decode_workers < 1:
        raise ConfigError(f"--decode-workers must be at least 1, got {decode_workers}")
    if prefill_workers < 0:
        raise ConfigError(f"--prefill-workers must be >= 0, got {prefill_workers}")
    if prefill_workers == 0 and not policy.decode_fallback:
        raise ConfigError("--prefill-workers 0 with --no-decode-fallback leaves no worker to prefill")
    sim = _Simulation(prefill_workers=prefill_workers, decode_workers=decode_workers, mode=mode, mocker=mocker,
                      router_config=router_config, seed=seed, policy=policy, transfer=transfer or TransferModel(),
                      planner=planner, sla_targets=sla_targets)
    sim.run(requests)
    return sim.report(mode)
