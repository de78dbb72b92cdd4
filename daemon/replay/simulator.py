"""Discrete-event replay: real router code and real mocker cores on a simulated clock.

Each worker is a ``MockerCore`` (the same scheduler, block manager and timing model the daemon
runs). A worker that has work runs one engine step at a time: the step's duration comes from the
timing model, and its tokens, finished requests and KV events take effect when the step ends. The
router sees exactly what a live router would: KV events as workers publish them, first tokens
(prefill done) and completions, with the simulated clock as its clock. Nothing sleeps, so a
1,000-second trace replays in seconds.

Most steps of a long replay only decode: each running request gets one token, no block is
allocated or cached, nothing finishes or is admitted (``MockerCore.decode_stretch``). No one but
the requests' own token times can tell such a step happened, so a core runs a stretch of them as
one ``_DecodeRun``: the loop schedules only its last step and the core applies them all at once
(``run_plain_decode_steps``). A stretch also takes in the step before it when that step's end is
unseen (it took a new block and published nothing) and the step after it that fills a block (run
with ``step(admit=False)`` at the stretch's end, which is that step's end, where its ``KvStored``
is published). The result is the step-by-step replay's to the last digit
(``fast_forward=False`` runs that reference; tests compare the two): a request arriving at the
core cuts the stretch after the step in progress, and a step of the stretch ending at the very
instant of another event becomes its last, so simultaneous events keep the order step-by-step
processing gives them (heap entries are ordered by time, then the time they were pushed, then push
order, which is the reference's order; a stretch's steps use the push order of its first).

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
4. the decode stage is routed for real, as the frontend does: with the policy's
   ``decode_overlap_weight`` when the prompt goes remote (the blocks it caches do not travel; 0 is
   Dynamo's decode stage), with the usual weight when local;
5. remote: the prefill core runs the prompt with ``max_tokens=1``. The KV blocks the decode
   worker lacks (at dispatch) move chunk by chunk as the prefill computes them, over the decode
   worker's link (``TransferModel``, ``--kv-transfer-overlap chunk``), or all at once after the
   prefill's last step (``none``); when the last lands, the decode core takes the request with
   ``kv_transferred=True`` (its prompt occupies the decode cache at no compute) and decodes.
   Local: the decode core prefills it itself, exactly as in agg mode.

TTFT is what the client sees: arrival to the first token the *decode* worker streams. The token
the prefill worker samples is discarded (Dynamo's frontend takes only the transfer parameters from
the prefill stream, and the decode engine samples the first output token itself), so both modes
count the same ``output_length`` tokens, all from the worker that streams them, and a remote TTFT
includes prefill queueing, prefill compute, the KV transfer and the decode worker's first step.
"""

from __future__ import annotations

import bisect
import collections
import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.core import MockerCore, StepOutput
from dynamod.daemon.engines.mocker.request import MockRequest
from dynamod.daemon.engines.mocker.scheduler import DecodeStretch
from dynamod.daemon.replay.fleet import DRAINING, READY, STARTING, STOPPED
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
from dynamod.daemon.router.core.config import KvRouterConfig
from dynamod.daemon.router.core.disagg_cost import (
    DEFAULT_NUM_LAYERS,
    OVERLAP_CHUNK,
    OVERLAP_LAYER,
    OVERLAP_NONE,
    OVERLAPS,
    MockerCompute,
    TransferEstimate,
    pipelined_end_ms,
)
from dynamod.daemon.router.core.disagg_policy import DisaggInputs, DisaggPolicyConfig, decide
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.daemon.router.core.local_choice import LocalPrefillChoice
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, RouterEvent
from dynamod.shared.protocol.llm import MultimodalItem
from dynamod.shared.protocol.routing import DISAGG_REMOTE, DisaggInfo

MODES = ("kv", "round-robin", "random")

# A Llama-3-8B-like layout: 32 layers x 8 KV heads x 128 head dim x 2 (K and V) x 2 bytes (bf16).
DEFAULT_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
DEFAULT_KV_TRANSFER_BANDWIDTH_GB_S = 25.0  # one RDMA NIC's worth, 200 Gb/s
DEFAULT_KV_TRANSFER_LATENCY_MS = 1.0  # per transfer: metadata round trip and completion notice


@dataclass(frozen=True, slots=True)
class TransferModel:
    """How long moving a prompt's KV blocks from a prefill worker to a decode worker takes.

    ``overlap`` ``chunk`` (the default): the decode worker is chosen when the prefill is
    dispatched and each prefill chunk's blocks start moving when that chunk's step ends (the
    prefix the prefill worker caches when its first step begins); the decode worker's inbound link
    moves them in the order they became ready, shared by every transfer into that worker; the
    decode worker takes the request ``latency_ms`` (the completion notice) after its last block
    lands. ``layer``: the same, but a step's blocks move layer by layer as the step computes them
    (``num_layers`` equal parts, the first ready ``1/num_layers`` into the step).

    ``none`` (the replay before issue 23): the whole transfer starts when the prefill ends and
    transfers are independent (no link contention).

    ``bandwidth_gb_s`` is in 10^9 bytes per second.
    """

    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    bandwidth_gb_s: float = DEFAULT_KV_TRANSFER_BANDWIDTH_GB_S
    latency_ms: float = DEFAULT_KV_TRANSFER_LATENCY_MS
    overlap: str = OVERLAP_CHUNK
    num_layers: int = DEFAULT_NUM_LAYERS

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAPS:
            raise ConfigError(f"--kv-transfer-overlap must be one of {', '.join(OVERLAPS)}, got {self.overlap!r}")
        if self.num_layers < 1:
            raise ConfigError(f"--kv-num-layers must be at least 1, got {self.num_layers}")
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

    def link_ms(self, nbytes: int) -> float:
        """The link time of ``nbytes``, without the per-transfer latency."""
        return nbytes / (self.bandwidth_gb_s * 1e9) * 1000.0


@dataclass(slots=True)
class _Transfer:
    """A remote prefill's KV blocks on their way to its decode worker (chunk-wise transfer).

    Blocks ``[0, first_block)`` are cached on the decode worker and do not travel; blocks up to
    ``queued`` have been handed to the worker's link, the last of them landing at ``lands_ms``."""

    worker: int
    prompt_tokens: int
    first_block: int
    queued: int
    lands_ms: float
    link_ms: float = 0.0  # link time of its own bytes


@functools.lru_cache(maxsize=8)
def _mocker_compute(max_num_batched_tokens: int, speedup_ratio: float) -> MockerCompute:
    """The cost policy's compute model in a replay: the cores' own timing."""
    return MockerCompute(max_num_batched_tokens, speedup_ratio)


@functools.lru_cache(maxsize=8)
def _transfer_estimate(t: TransferModel) -> TransferEstimate:
    """The cost policy's transfer estimate in a replay: the replay's own transfer model."""
    return TransferEstimate(t.kv_bytes_per_token, t.bandwidth_gb_s, t.latency_ms, overlap=t.overlap, num_layers=t.num_layers)


class _PromptHashes:
    """Each prompt's block hashes, computed once per request and handed to every router and core.

    A remote request's prompt is hashed by the decode router's estimate, the prefill router, the
    decode router, the prefill core, the transfer's size and the decode core: six C passes over
    thousands of tokens and their chained hashes, where an aggregated replay hashes twice. They are
    all the same hashes (one block size, no LoRA), so they are computed at the first use (measured:
    6-12 % of a disaggregated replay's CPU time, the more the longer the prompts). An entry lives until the core that decodes the request admits it
    (``for_core(last=True)``), so only requests between arrival and admission hold one.
    """

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._by_request: dict[str, tuple[int, list[int], list[int]]] = {}
        # The images of requests that have some (trace.py): their content keys the blocks covering them.
        self._images: dict[str, list[MultimodalItem]] = {}

    def set_images(self, request_id: str, images: list[MultimodalItem]) -> None:
        """Request ``request_id``'s prompt has ``images``: its hashes key the blocks covering them."""
        self._images[request_id] = images

    def of(self, request_id: str, prompt: list[int]) -> tuple[list[int], list[int]]:
        """(local, sequence) hashes of request ``request_id``'s ``prompt``; read only (shared)."""
        entry = self._by_request.get(request_id)
        if entry is None or entry[0] != len(prompt):
            local, seq = hash_tokens(prompt, self._block_size, None, self._images.get(request_id))
            entry = self._by_request[request_id] = (len(prompt), local, seq)
        return entry[1], entry[2]

    def for_core(self, request: MockRequest, *, last: bool) -> tuple[list[int], list[int]]:
        """A core's ``prompt_hasher``: copies the request owns (it extends them over generated
        tokens). ``last``: this core decodes the request, the entry's last use."""
        if request.lora_name is not None:  # a replay has none; a LoRA seeds its hashes differently
            return hash_tokens(request.token_ids, self._block_size, request.lora_name)
        local, seq = self.of(request.request_id, request.token_ids)
        if last:
            del self._by_request[request.request_id]
            self._images.pop(request.request_id, None)
        return local.copy(), seq.copy()

    def __len__(self) -> int:
        return len(self._by_request)


class _Picker:
    """The routing policy of one pool: KV-aware (the real KvRouter) or a simple baseline.

    ``keep_index``: also keep a KV index of the pool in round-robin / random mode, so that a
    disaggregated replay can ask how much of a prompt the chosen decode worker caches whatever the
    routing policy (the live system learns it from the same KV events).
    """

    def __init__(self, mode: str, n_workers: int, block_size: int, clock: Callable[[], float], seed: int,
                 router_config: KvRouterConfig | None, *, keep_index: bool = False,
                 hashes: _PromptHashes | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"unknown router mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self._hashes = hashes or _PromptHashes(block_size)
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

    def pick(self, rid: str, prompt: list[int], overlap_weight: float | None = None,
             local_prefill: LocalPrefillChoice | None = None) -> tuple[int, int | None]:
        """The worker for request ``rid`` and, in kv mode, the prompt blocks it caches (else None).
        ``overlap_weight`` overrides the router's (0 for a decode stage after remote prefill);
        ``local_prefill``: the decode stage of a prompt kept local (``KvRouter.select_worker``)."""
        if self._routes:
            assert self.router is not None
            decision = self.router.select_worker(rid, prompt, overlap_weight=overlap_weight,
                                                 prompt_hashes=self._hashes.of(rid, prompt), local_prefill=local_prefill)
            return decision.worker_id, decision.overlap_blocks
        if self.mode == "random":
            return self._ids[self._rng.randrange(len(self._ids))], None
        return self._ids[next(self._rr) % len(self._ids)], None

    def estimate(self, rid: str, prompt: list[int]) -> tuple[int, int] | None:
        """kv mode: the worker ``pick`` would choose and the blocks it caches, counting nothing
        (what the live router's decode estimate gives the disaggregation policy); else None."""
        if not self._routes:
            return None
        assert self.router is not None
        decision = self.router.best_worker(rid, prompt, prompt_hashes=self._hashes.of(rid, prompt))
        return decision.worker_id, decision.overlap_blocks

    def cached_blocks(self, worker: int, prompt: list[int], rid: str | None = None) -> int:
        """Leading prompt blocks ``worker`` caches now, by the pool's KV index (0 without one).
        ``rid``: the request's, whose prompt hashes are then reused."""
        if self.router is None:
            return 0
        _, seq = hash_tokens(prompt, self._block_size) if rid is None else self._hashes.of(rid, prompt)
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


# Event kinds. Events at the same instant run in the order they were pushed (the heap keys after
# the time), which keeps a replay deterministic.
_ARRIVAL, _STEP_DONE, _TRANSFER_DONE, _PLANNER_TICK, _WORKER_READY, _DECODE_RUN_DONE = 0, 1, 2, 3, 4, 5

# Core lifecycle (planner replays, fleet.py's states): launched -> STARTING -> READY -> DRAINING -> STOPPED.


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
    # When each core's inbound KV link is next free (chunk-wise transfer into a decode core).
    link_free_ms: list[float] = field(default_factory=list)
    # The stretch of decode steps each core is in, if any (``_DecodeRun``).
    runs: list[_DecodeRun | None] = field(default_factory=list)
    # Where the cores' admitted prompts' hashes come from (``_PromptHashes.for_core``), or None.
    prompt_hasher: Callable[[MockRequest], tuple[list[int], list[int]]] | None = None

    @classmethod
    def create(cls, name: str, n: int, mocker: MockerConfig,
               prompt_hasher: Callable[[MockRequest], tuple[list[int], list[int]]] | None = None) -> _Pool:
        return cls(name, [MockerCore(mocker, prompt_hasher=prompt_hasher) for _ in range(n)], [False] * n, [0] * n,
                   state=[READY] * n, launched_ms=[0.0] * n, stopped_ms=[-1.0] * n, incoming=[0] * n,
                   link_free_ms=[0.0] * n, runs=[None] * n, prompt_hasher=prompt_hasher)

    def ids(self, state: str) -> list[int]:
        return [w for w, st in enumerate(self.state) if st == state]

    def launch(self, mocker: MockerConfig, now_ms: float) -> int:
        """A new core, STARTING: it takes no work until the planner loop marks it READY."""
        self.cores.append(MockerCore(mocker, prompt_hasher=self.prompt_hasher))
        self.busy.append(False)
        self.inflight_prefill.append(0)
        self.state.append(STARTING)
        self.launched_ms.append(now_ms)
        self.stopped_ms.append(-1.0)
        self.incoming.append(0)
        self.link_free_ms.append(now_ms)
        self.runs.append(None)
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


@dataclass(slots=True, eq=False)
class _DecodeRun:
    """A stretch of decode steps of one core, run at once when its last step ends.

    Its steps: optionally a first one already run (``first``: a step whose end nobody sees, such
    as one that took a new block), ``plain`` plain ones, then optionally the block-filling one
    (``fills``: its ``KvStored`` is seen at its end, the stretch's end). ``ends[i]`` is when step
    ``i + 1`` ends: the same float sums a step-by-step replay computes. Only the first ``steps``
    are run: the stretch is cut short when a request arrives at the core or another event falls on
    the instant one of its steps ends. ``order`` is the push order its first step would have had,
    ``version`` tells its current last-step heap entry from old ones.
    """

    pool: _Pool
    worker: int
    order: int
    start_ms: float
    step_ms: float
    ends: list[float]
    steps: int
    first: StepOutput | None = None  # a step already run on the core (its end unseen), or None
    plain: int = 0  # then this many plain steps
    fills: bool = False  # then one block-filling step, run when the stretch ends
    version: int = 0
    shares_an_instant: bool = False  # another stretch has a step ending at one of its instants

    def last_step_entry(self) -> tuple[float, float, int, int, object]:
        """The heap entry of its last step: keyed as the reference would push that step."""
        n = self.steps
        started = self.ends[n - 2] if n >= 2 else self.start_ms
        return (self.ends[n - 1], started, self.order, _DECODE_RUN_DONE, (self, self.version))


class _Simulation:
    """The event loop shared by agg and disaggregated replays (agg: no policy, no prefill pool)."""

    def __init__(self, *, prefill_workers: int, decode_workers: int, mode: str, mocker: MockerConfig,
                 router_config: KvRouterConfig | None, seed: int, policy: DisaggPolicyConfig | None,
                 transfer: TransferModel, planner: ReplayPlanner | None = None,
                 sla_targets: tuple[float, float] | None = None, fast_forward: bool = True) -> None:
        self.now = 0.0
        self.fast_forward = fast_forward
        self.sla_targets = sla_targets
        self.planner = planner
        self._to_arrive = 0
        self._open = 0  # arrived, not finished (read as ``open_requests``)
        self.mocker = mocker
        self.policy = policy
        # The decode-worker choice for a prompt kept local: made once, the mocker's own timing.
        self.local_prefill = None if policy is None else policy.local_prefill_choice(
            _mocker_compute(mocker.max_num_batched_tokens, mocker.speedup_ratio))
        self.transfer = transfer
        self.router_config = router_config or KvRouterConfig()

        def clock() -> float:
            return self.now / 1000.0

        disagg = policy is not None
        # One hashing per prompt for both pools' routers and cores; the decode pool admits last.
        self.hashes = hashes = _PromptHashes(mocker.block_size)
        self.decode = _Pool.create("decode" if disagg else "agg", decode_workers, mocker,
                                   functools.partial(hashes.for_core, last=True))
        self.prefill = _Pool.create("prefill", prefill_workers, mocker, functools.partial(hashes.for_core, last=False))
        self.decode_picker = _Picker(mode, decode_workers, mocker.block_size, clock, seed, router_config, keep_index=disagg,
                                     hashes=hashes)
        # A different seed: the two pools' tie-breaks must not mirror each other.
        self.prefill_picker = (
            _Picker(mode, prefill_workers, mocker.block_size, clock, seed + 1, router_config, hashes=hashes)
            if prefill_workers else None
        )
        self.stats: dict[str, RequestStats] = {}
        self.reasons: dict[str, int] = {}
        # Remote prefills in flight: the request and its prompt, until its KV reaches the decode core.
        self._requests: dict[str, tuple[TraceRequest, list[int]]] = {}
        # Chunk-wise transfers in flight, from the prefill's dispatch to the decode core's admission.
        self._transfers: dict[str, _Transfer] = {}
        # (time, time it was pushed, push order, kind, payload): pushes happen in time order, so
        # this orders events exactly as (time, push order) does, and lets a stretch of plain decode
        # steps key its last step as the step-by-step reference would.
        self._heap: list[tuple[float, float, int, int, object]] = []
        self._order = itertools.count()
        # Instant -> the stretch (or stretches) with a step ending then that is not its last.
        self._inner_ends: dict[float, _DecodeRun | list[_DecodeRun]] = {}

    # ---- the loop ------------------------------------------------------------------------------


    @property
    def open_requests(self) -> int:
        """Requests that arrived and have not finished: a frontend's in-flight gauge."""
        return self._open
    def run(self, requests: list[TraceRequest]) -> None:
        self.now = -math.inf  # pushed before anything happens: first among events at their instant
        for req in requests:
            self._push(req.arrival_ms, _ARRIVAL, req)
        self._to_arrive = len(requests)
        if self.planner is not None:
            self._push(self.planner.interval_ms, _PLANNER_TICK, None)
        self.now = 0.0
        heap = self._heap
        inner_ends = self._inner_ends
        while heap:
            entry = heapq.heappop(heap)
            at, _, _, kind, payload = entry
            if kind == _DECODE_RUN_DONE and payload[1] != payload[0].version:  # type: ignore[index]
                continue  # the stretch was cut short; its new last step has its own entry
            if inner_ends and at in inner_ends:
                # A stretch has a step ending at this very instant: make it the stretch's last, so
                # the heap orders the two as the step-by-step reference would, and look again.
                self._cut_runs_at(at)
                heapq.heappush(heap, entry)
                continue
            self.now = at
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
                self._next_step(pool, w)
            elif kind == _DECODE_RUN_DONE:
                self._finish_run(payload[0])  # type: ignore[index]
            else:
                self._transfer_done(payload)  # type: ignore[arg-type]

    def _next_step(self, pool: _Pool, w: int) -> None:
        """After a step of core ``w`` ended: the next one, or idle (and stop, if draining)."""
        if pool.cores[w].has_unfinished_requests():
            self._start_step(pool, w)
        else:
            pool.busy[w] = False
            if pool.state[w] == DRAINING and pool.idle(w):
                self.stop_core(pool, w)

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
        heapq.heappush(self._heap, (at_ms, self.now, next(self._order), kind, payload))

    def _start_step(self, pool: _Pool, w: int) -> None:
        core = pool.cores[w]
        stretches = self.fast_forward and pool is not self.prefill  # a prefill core never decodes
        if stretches:
            stretch = core.decode_stretch()
            if stretch.plain + stretch.then_fills >= 2:
                self._start_run(pool, w, stretch, None)
                return
        out = core.step()
        if not (out.num_prefill_reqs or out.num_decode_reqs or out.req_ids or out.finished):
            pool.busy[w] = False  # nothing could run; the next request wakes the worker
            return
        # A step may take no time yet make progress: a transferred prompt is admitted chunk by
        # chunk at no compute cost. Its next step then runs at the same instant.
        pool.busy[w] = True
        pool.inflight_prefill[w] = out.num_prefill_tokens
        pool.log.record(out.duration_ms, out.num_decode_reqs, out.num_prefill_tokens)
        if self._transfers and out.prefill_progress and pool is self.prefill:
            layers = self.transfer.num_layers if self.transfer.overlap == OVERLAP_LAYER else 0
            for rid, before, after in out.prefill_progress:
                self._ship(rid, before)  # its cached prefix is ready now
                if layers:  # the step's blocks move layer by layer while it computes them
                    self._ship(rid, after, self.now + out.duration_ms, layers)
        if stretches and self._end_unseen(out):
            stretch = core.decode_stretch()
            if stretch.plain + stretch.then_fills:
                self._start_run(pool, w, stretch, out)  # this step is the stretch's first
                return
        self._push(self.now + out.duration_ms, _STEP_DONE, (pool, w, out))

    def _end_unseen(self, out: StepOutput) -> bool:
        """Whether nothing happens at the end of a decode core's step but its tokens' arrival: it
        only decoded requests that had streamed before (no prefill, no first token), published no
        KV event and finished nothing. Such a step (one that took a new block, typically) can be
        the first of the stretch that follows it."""
        if out.num_prefill_reqs or out.kv_events or out.finished or out.num_preempted or out.remote_loads:
            return False
        stats = self.stats
        return all(stats[rid].token_times for rid in out.req_ids)

    def _wake(self, pool: _Pool, w: int) -> None:
        if not pool.busy[w]:
            self._start_step(pool, w)

    # ---- stretches of plain decode steps -------------------------------------------------------

    def _start_run(self, pool: _Pool, w: int, stretch: DecodeStretch, first: StepOutput | None) -> None:
        """Core ``w`` begins a stretch: ``first`` (a step already run, see ``_end_unseen``), the
        plain steps, then the block-filling step if the stretch announces one."""
        step_ms = pool.cores[w].plain_decode_step_ms()
        start = self.now
        after = stretch.plain + stretch.then_fills
        # now + d, (now + d) + d, ...: the sums stepping one by one makes, left to right.
        if first is None:
            ends = list(itertools.accumulate(itertools.repeat(step_ms, after), initial=start))
            del ends[0]
        else:
            ends = list(itertools.accumulate(itertools.repeat(step_ms, after), initial=start + first.duration_ms))
        run = _DecodeRun(pool, w, next(self._order), start, step_ms, ends, len(ends), first=first,
                         plain=stretch.plain, fills=stretch.then_fills)
        pool.runs[w] = run
        pool.busy[w] = True
        pool.inflight_prefill[w] = 0
        self._remember_inner_ends(run)
        heapq.heappush(self._heap, run.last_step_entry())

    def _finish_run(self, run: _DecodeRun) -> None:
        """The stretch's last step ended: run its steps on the core, as if stepped one by one."""
        pool, w, steps = run.pool, run.worker, run.steps
        self._forget_inner_ends(run, 0, steps - 1)
        pool.runs[w] = None
        core = pool.cores[w]
        stats = self.stats
        ends = run.ends
        done = 0
        if run.first is not None:  # already run on the core when the stretch began
            at = ends[0]
            for rid in run.first.req_ids:
                stats[rid].token_times.append(at)
            done = 1
        plain = min(steps - done, run.plain)
        if plain:
            request_ids = core.run_plain_decode_steps(plain)
            pool.log.record_plain_decode_steps(run.step_ms, plain)
            times = ends[done : done + plain]
            for rid in request_ids:
                stats[rid].token_times.extend(times)
        pool.inflight_prefill[w] = 0
        if done + plain < steps:
            # The block-filling step: it began before any request that arrived since, so those
            # wait; its KV events and tokens are seen now, at its end, as a step's always are.
            out = core.step(admit=False)
            if out.duration_ms != run.step_ms or out.finished or out.num_prefill_reqs:
                raise RuntimeError(f"a stretch's last step was not the block-filling step announced: {out}")
            pool.log.record(out.duration_ms, out.num_decode_reqs, out.num_prefill_tokens)
            self._decode_step_done(w, out)
        self._next_step(pool, w)

    def _cut_run(self, run: _DecodeRun, steps: int) -> None:
        """Makes step ``steps`` (1-based) the stretch's last."""
        self._forget_inner_ends(run, steps - 1, run.steps - 1)
        run.steps = steps
        run.version += 1
        heapq.heappush(self._heap, run.last_step_entry())

    def _cut_runs_at(self, at: float) -> None:
        entry = self._inner_ends[at]
        for run in entry if isinstance(entry, list) else [entry]:
            self._cut_run(run, bisect.bisect_left(run.ends, at, 0, run.steps - 1) + 1)

    def _interrupt_run(self, pool: _Pool, w: int) -> None:
        """A request is about to reach core ``w``: a stretch it is in ends with the step in
        progress, after which the request can be admitted (as after any step)."""
        run = pool.runs[w]
        if run is not None:
            done = bisect.bisect_right(run.ends, self.now, 0, run.steps)
            if done + 1 < run.steps:
                self._cut_run(run, done + 1)

    def _remember_inner_ends(self, run: _DecodeRun) -> None:
        inner = self._inner_ends
        ends = run.ends[: run.steps - 1]
        if inner.keys().isdisjoint(ends):
            inner.update(dict.fromkeys(ends, run))
            return
        for at in ends:  # another core's step ends at the very same instant as one of these
            other = inner.setdefault(at, run)
            if other is not run:
                others = other if isinstance(other, list) else [other]
                for o in others:
                    o.shares_an_instant = True
                run.shares_an_instant = True
                inner[at] = [*others, run]

    def _forget_inner_ends(self, run: _DecodeRun, lo: int, hi: int) -> None:
        inner = self._inner_ends
        if not run.shares_an_instant:
            collections.deque(map(inner.pop, run.ends[lo:hi]), maxlen=0)  # a C loop
            return
        for at in run.ends[lo:hi]:
            other = inner.pop(at)
            if other is not run:  # shared with another stretch: keep it there
                rest = [r for r in other if r is not run]  # type: ignore[union-attr]
                inner[at] = rest[0] if len(rest) == 1 else rest

    # ---- requests ------------------------------------------------------------------------------

    def _arrive(self, req: TraceRequest) -> None:
        rid = str(req.index)
        prompt = req.prompt  # built once here; the cores copy it, and it is dropped when they have it
        if req.images:
            self.hashes.set_images(rid, req.images)
        if self.policy is None:
            dw, _ = self.decode_picker.pick(rid, prompt)
            self.stats[rid] = RequestStats(arrival_ms=self.now, prompt_tokens=len(prompt), worker=dw)
            self._start_local(req, rid, prompt, dw)
            return
        # As the live frontend: the decode worker normal KV routing would pick (counting nothing)
        # gives the effective ISL; after the decision the decode stage is routed for real, with the
        # policy's overlap weight for a remote prompt (``decode_overlap_weight``, as live).
        # Round-robin and random choose the same worker either way, so they choose once.
        estimate = self.decode_picker.estimate(rid, prompt)
        chosen = estimate is None
        dw, overlap = self.decode_picker.pick(rid, prompt) if estimate is None else estimate
        st = self.stats[rid] = RequestStats(arrival_ms=self.now, prompt_tokens=len(prompt), worker=dw)
        info, pw = self._decide(rid, prompt, dw, overlap)
        st.reason = info.reason
        self.reasons[info.reason] = self.reasons.get(info.reason, 0) + 1
        remote = info.mode == DISAGG_REMOTE
        if not chosen:
            dw, _ = self.decode_picker.pick(
                rid, prompt, overlap_weight=self.policy.decode_overlap_weight(remote),
                local_prefill=None if remote else self.local_prefill,
            )
            st.worker = dw
        if not remote:
            self._start_local(req, rid, prompt, dw)
            return
        st.remote = True
        st.prefill_worker = pw
        # The decode worker will not compute this prompt: its router stops counting it as prefill
        # load now and keeps only its blocks as decode load.
        self.decode_picker.on_first_token(rid)
        self._requests[rid] = (req, prompt)
        if self.transfer.overlap != OVERLAP_NONE:
            # The decode worker is known now: the blocks it lacks move as the prefill computes them.
            cached = self.decode_picker.cached_blocks(dw, prompt, rid)
            self._transfers[rid] = _Transfer(dw, len(prompt), cached, cached, self.now)
            self.decode.incoming[dw] += 1
        self._interrupt_run(self.prefill, pw)
        self.prefill.cores[pw].add_request(rid, prompt, max_tokens=1, ignore_eos=True, seed=req.index,
                                           check_tokens=False, mm_items=req.images)
        self._wake(self.prefill, pw)

    def _start_local(self, req: TraceRequest, rid: str, prompt: list[int], dw: int) -> None:
        self._interrupt_run(self.decode, dw)
        self.decode.cores[dw].add_request(rid, prompt, max_tokens=req.output_length, ignore_eos=True, seed=req.index,
                                          check_tokens=False, mm_items=req.images)
        self._wake(self.decode, dw)

    def _decide(self, rid: str, prompt: list[int], dw: int, overlap: int | None) -> tuple[DisaggInfo, int]:
        """Remote or local prefill for request ``rid`` with decode candidate ``dw``; the prefill
        worker (-1 without one). A prefill worker routed to but not used hears at once it will not be.
        The ``cost`` policy computes with the cores' own timing model and the replay's transfer model."""
        assert self.policy is not None
        bs = self.mocker.block_size
        isl = len(prompt)
        if overlap is None:
            overlap = self.decode_picker.cached_blocks(dw, prompt, rid)
        decode_load = self.decode.cores[dw].load()
        new_blocks = -(-isl // bs) - overlap
        available = self.prefill_picker is not None and bool(self.prefill.ids(READY))
        pw = -1
        prefill_cached = 0
        if available:
            assert self.prefill_picker is not None
            pw, prefill_overlap = self.prefill_picker.pick(rid, prompt)
            if prefill_overlap is None:
                prefill_overlap = self.prefill_picker.cached_blocks(pw, prompt, rid)
            prefill_cached = min(prefill_overlap * bs, isl)
        t = self.transfer
        inputs = DisaggInputs(
            isl=isl,
            decode_cached_tokens=min(overlap * bs, isl),
            prefill_available=available,
            prefill_load=float(self.prefill.prefill_load_tokens(pw)) if available else None,
            prefill_busy_threshold=self.router_config.active_prefill_tokens_threshold,
            decode_kv_fraction=(decode_load.active_blocks + new_blocks) / decode_load.total_blocks,
            prefill_worker_id=pw if available else None,
            decode_worker_id=dw,
            decode_queued_tokens=decode_load.active_prefill_tokens + self.decode.inflight_prefill[dw],
            running_decodes=decode_load.num_running,
            prefill_cached_tokens=prefill_cached,
            transfer=_transfer_estimate(t),
        )
        info = decide(self.policy, inputs, _mocker_compute(self.mocker.max_num_batched_tokens, self.mocker.speedup_ratio))
        if info.mode != DISAGG_REMOTE and self.prefill_picker is not None and pw >= 0:
            self.prefill_picker.on_finish(rid)  # routed there, but it will not prefill there
        return info, pw

    def _prefill_step_done(self, w: int, out: StepOutput) -> None:
        picker = self.prefill_picker
        assert picker is not None
        picker.on_step(w, out)
        bs = self.mocker.block_size
        if self._transfers:
            for rid, _, after in out.prefill_progress:  # this step's chunks are ready now
                self._ship(rid, after)
        for fin in out.finished:
            rid = fin.request_id
            picker.on_finish(rid)
            st = self.stats[rid]
            st.prefill_done_ms = self.now
            st.cached_tokens = fin.usage.cached_tokens
            tr = self._transfers.get(rid)
            if tr is not None:
                st.transfer_bytes = self.transfer.bytes_for(tr.queued - tr.first_block, bs)
                st.transfer_ms = self.transfer.latency_ms + tr.link_ms
                landed = max(tr.lands_ms, self.now) + self.transfer.latency_ms
                st.exposed_transfer_ms = landed - self.now
                self._push(landed, _TRANSFER_DONE, rid)
                continue
            _, prompt = self._requests[rid]
            # Only the blocks the decode worker lacks travel; it caches the rest already.
            lacking = -(-len(prompt) // bs) - self.decode_picker.cached_blocks(st.worker, prompt, rid)
            st.transfer_bytes = self.transfer.bytes_for(lacking, bs)
            st.transfer_ms = st.exposed_transfer_ms = self.transfer.time_ms(st.transfer_bytes)
            self.decode.incoming[st.worker] += 1
            self._push(self.now + st.transfer_ms, _TRANSFER_DONE, rid)

    def _ship(self, rid: str, computed_tokens: int, computed_ms: float | None = None, layers: int = 1) -> None:
        """The blocks of request ``rid`` within its first ``computed_tokens`` prompt tokens are
        computed (by ``computed_ms``, from now, in ``layers`` parts; None: now, at once): those its
        decode worker lacks and that were not handed to the link yet join the link's queue (a
        partial last block goes with the prompt's end)."""
        tr = self._transfers.get(rid)
        if tr is None:
            return
        bs = self.mocker.block_size
        ready = -(-tr.prompt_tokens // bs) if computed_tokens >= tr.prompt_tokens else computed_tokens // bs
        if ready <= tr.queued:
            return
        ms = self.transfer.link_ms(self.transfer.bytes_for(ready - tr.queued, bs))
        tr.queued = ready
        link = self.decode.link_free_ms
        if computed_ms is None:
            tr.lands_ms = link[tr.worker] = max(self.now, link[tr.worker]) + ms
        else:
            tr.lands_ms = link[tr.worker] = pipelined_end_ms(link[tr.worker], ms, self.now, computed_ms, layers)
        tr.link_ms += ms

    def _transfer_done(self, rid: str) -> None:
        self._transfers.pop(rid, None)
        req, prompt = self._requests.pop(rid)
        dw = self.stats[rid].worker
        self.decode.incoming[dw] -= 1
        self._interrupt_run(self.decode, dw)
        self.decode.cores[dw].add_request(
            rid, prompt, max_tokens=req.output_length, ignore_eos=True, seed=req.index, kv_transferred=True,
            check_tokens=False, mm_items=req.images,
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
                "transfer_overlap": self.transfer.overlap,
                "transfer_ms": summary((s.transfer_ms for s in remote), P50, P99),
                "exposed_transfer_ms": summary((s.exposed_transfer_ms for s in remote), P50, P99),
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
        tiers = self.tier_hit_rates()
        if tiers is not None:
            res["kv_tiers"] = tiers
        res["sim_s"] = round(sim_s, 3)
        end_ms = max((s.finish_ms for s in done), default=0.0)
        if self.sla_targets is not None:
            res["sla"] = sla_figures(done, *self.sla_targets)
        res["worker_seconds"] = round(self.decode.worker_seconds(end_ms) + self.prefill.worker_seconds(end_ms), 3)
        if self.planner is not None:
            res["planner"] = self.planner.report(self, done, end_ms)
        return res


    def tier_hit_rates(self) -> dict[str, object] | None:
        """With host/disk KV tiers: the share of prompt tokens each tier served (device hits,
        onboarded from host, from disk) and the blocks moved, summed over every core."""
        cores = [c for pool in (self.prefill, self.decode) for c in pool.cores if c.tiers is not None]
        if not cores:
            return None
        prompt = sum(c.scheduler.prompt_tokens_seen for c in cores)
        cached = sum(c.scheduler.cached_tokens_seen for c in cores)
        by_tier = {m: sum(c.scheduler.onboarded_tokens_seen.get(m, 0) for c in cores) for m in (MEDIUM_CPU, MEDIUM_DISK)}
        device = cached - sum(by_tier.values())

        def rate(n: int) -> float:
            return round(n / prompt, 4) if prompt else 0.0

        return {
            "hit_rate": {MEDIUM_GPU: rate(device), MEDIUM_CPU: rate(by_tier[MEDIUM_CPU]),
                         MEDIUM_DISK: rate(by_tier[MEDIUM_DISK]), "total": rate(cached)},
            "onboarded_blocks": {m: sum(c.tiers.stats.onboarded[m] for c in cores) for m in by_tier},  # type: ignore[union-attr]
            "offloaded_blocks": {m: sum(c.tiers.stats.offloaded[m] for c in cores) for m in by_tier},  # type: ignore[union-attr]
            "onboard_ms_total": round(sum(c.tiers.stats.onboard_ms for c in cores), 3),  # type: ignore[union-attr]
        }


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
    fast_forward: bool = True,
) -> dict:
    """Replays ``requests`` on ``workers`` aggregated workers; returns the summary (the ``--json``
    object, without wall time). With ``planner``, ``workers`` is the starting count and the
    planner resizes the pool every interval; ``sla_targets`` (TTFT ms, ITL ms) adds attainment.
    ``fast_forward=False`` steps every core one step at a time: the reference, same figures."""
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    sim = _Simulation(prefill_workers=0, decode_workers=workers, mode=mode, mocker=mocker,
                      router_config=router_config, seed=seed, policy=None, transfer=TransferModel(),
                      planner=planner, sla_targets=sla_targets, fast_forward=fast_forward)
    sim.run(requests)
    return sim.report(mode)


def check_disagg_pools(prefill_workers: int, decode_workers: int, *, decode_fallback: bool) -> None:
    """``ConfigError`` for pool sizes a disaggregated replay cannot run: no decode worker, a
    negative prefill pool, or no prefill pool without the decode fallback to prefill locally."""
    if prefill_workers < 0:
        raise ConfigError(f"--prefill-workers must be >= 0, got {prefill_workers}")
    if decode_workers < 1:
        raise ConfigError(f"--decode-workers must be at least 1, got {decode_workers}")
    if prefill_workers == 0 and not decode_fallback:
        raise ConfigError("--prefill-workers 0 with --no-decode-fallback leaves no worker to prefill")


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
    fast_forward: bool = True,
) -> dict:
    """Replays ``requests`` on a prefill pool and a decode pool; returns the summary.

    ``policy`` None means Dynamo's default: unconditional disaggregation with decode fallback.
    """
    policy = policy or DisaggPolicyConfig()
    check_disagg_pools(prefill_workers, decode_workers, decode_fallback=policy.decode_fallback)
    sim = _Simulation(prefill_workers=prefill_workers, decode_workers=decode_workers, mode=mode, mocker=mocker,
                      router_config=router_config, seed=seed, policy=policy, transfer=transfer or TransferModel(),
                      planner=planner, sla_targets=sla_targets, fast_forward=fast_forward)
    sim.run(requests)
    return sim.report(mode)
