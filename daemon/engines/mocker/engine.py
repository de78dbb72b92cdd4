"""``MockerEngine``: the Engine Protocol (daemon/engines/base.py) around one core per DP rank.

Each data-parallel rank is a ``MockerCore`` driven by its own step-loop task, as each vLLM DP rank
is its own engine: the loop runs ``core.step()``, publishes the step's KV events at once (vLLM
publishes them when it schedules), waits until the step's simulated duration divided by
``--speedup-ratio`` has passed, then hands the step's tokens to the requests' streams.

Pacing keeps a running deadline, so oversleeping one step is made up by the next ones and the
simulated clock tracks the wall clock. Steps due within the event loop's timer resolution run back
to back without sleeping (their tokens reach a client together). If the loop ever falls more than
``_MAX_LAG_S`` behind it restarts its clock instead of bursting, and records the lag
(``loop_stats()``), so an overloaded host shows up as lag rather than as silent slowdown.

Given a ``kv_layout`` (a prefill or decode worker), the engine keeps its KV blocks as bytes in one
``KvBlockMemory`` for all ranks (rank r's block b is row ``r * num_gpu_blocks + b``, so one
transfer agent serves every rank) and, once the worker attaches its transfer agent
(``attach_kv_transfer``), holds prefill results and reads decode requests' KV (``transfer.py``).
Without a layout it keeps no bytes and pays nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from dynamod.daemon.engines.base import EngineInfo, EngineState, LoraInfo
from dynamod.daemon.engines.common.engine_base import EngineBookkeeping
from dynamod.daemon.engines.common.event_queue import RouterEventQueue
from dynamod.daemon.engines.kv_transfer import KvTransferContext
from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.core import CoreLoad, MockerCore, StepOutput
from dynamod.daemon.engines.mocker.guided import GuidedState, GuidedVocab
from dynamod.daemon.engines.mocker.request import request_seed
from dynamod.daemon.engines.mocker.streams import RequestStream
from dynamod.daemon.engines.mocker.trace_marks import TraceMarks
from dynamod.daemon.engines.mocker.transfer import REPORT_KEY, MockerKvTransfer, parse_transfer_params
from dynamod.shared.errors import (
    ConfigError,
    EngineError,
    InvalidRequestError,
    UnavailableError,
)
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.observability.tracing import engine_span
from dynamod.shared.protocol.kv_events import MEDIUM_GPU, KvEvent, RouterEvent
from dynamod.shared.protocol.kv_transfer import KvLayout, KvTransferParams
from dynamod.shared.protocol.llm import FINISH_ABORT, EngineOutput, PreprocessedRequest, Usage
from dynamod.shared.protocol.load import KvTierLoad, LoadMetrics
from dynamod.shared.protocol.model_card import RuntimeConfig

logger = logging.getLogger(__name__)

_TIMER_SLACK_S = 0.001  # the event loop's timer resolution: shorter waits are not worth a sleep
_MAX_LAG_S = 0.25  # behind by more than this: restart the clock instead of catching up in a burst
_MAX_BUSY_S = 0.005  # yield to the event loop at least this often while running back to back
DEFAULT_KV_EVENT_BUFFER = 65536
_GUIDED_SEED_SALT = 0x9E3779B97F4A7C15  # the grammar state's random stream differs from the sampler's



@dataclass(slots=True)
class LoopStats:
    """How one rank's step loop kept pace with the simulated clock."""

    steps: int = 0
    simulated_ms: float = 0.0  # step durations before speedup
    lag_sum_s: float = 0.0
    lag_max_s: float = 0.0
    clock_resets: int = 0  # times the loop fell more than _MAX_LAG_S behind
    idle_s: float = 0.0  # wall time spent with no request to run

    @property
    def lag_mean_s(self) -> float:
        return self.lag_sum_s / self.steps if self.steps else 0.0


class MockerEngine(EngineBookkeeping):
    """A simulated vLLM worker: real KV block management and scheduling, modelled step times."""

    ENGINE_NAME = "mocker"

    def __init__(
        self,
        config: MockerConfig,
        worker_id: int,
        *,
        kv_event_buffer: int = DEFAULT_KV_EVENT_BUFFER,
        kv_layout: KvLayout | None = None,
        tokenizer_path: Path | str | None = None,
    ) -> None:
        super().__init__(worker_id, self._engine_info(config))
        self.config = config
        # The model's vocabulary for structured outputs (``tokenizer_path``: its tokenizer.json);
        # loaded on the first constrained request.
        self._guided_vocab = GuidedVocab(tokenizer_path, config.vocab_size, list(config.eos_token_ids))
        self._kv_layout = kv_layout
        self._kv_memory = self._make_kv_memory(config, kv_layout) if kv_layout is not None else None
        self.cores = [
            MockerCore(config, rank, kv_memory=self._kv_memory, kv_layout=kv_layout)
            for rank in range(config.data_parallel_size)
        ]
        self._kv: MockerKvTransfer | None = None
        self._no_agent_logged = False
        self.sleep_level = 0  # 2 means the "weights" were released too
        self._event_id = -1  # last event id handed out; the first event is 0, as routers expect
        self._events = RouterEventQueue(worker_id, kv_event_buffer)
        self._wake = [asyncio.Event() for _ in self.cores]
        self._tasks: list[asyncio.Task[None]] = []
        self._stats = [LoopStats() for _ in self.cores]
        self._traced: dict[str, TraceMarks] = {}  # requests whose spans record (trace_marks.py)

    @staticmethod
    def _engine_info(config: MockerConfig) -> EngineInfo:
        return EngineInfo(
            kv_block_size=config.block_size,
            context_length=config.context_length,
            runtime_config=RuntimeConfig(
                total_kv_blocks=config.num_gpu_blocks,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                data_parallel_size=config.data_parallel_size,
            ),
            vocab_size=config.vocab_size,
            eos_token_ids=list(config.eos_token_ids),
        )

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._status == EngineState.STOPPED:
            raise EngineError("mocker engine was stopped; create a new one")
        if self._tasks:
            return
        self._status = EngineState.READY
        loop = asyncio.get_running_loop()
        for rank, core in enumerate(self.cores):
            # Blocks a persistent disk tier kept from the last run: the router learns them now.
            self._publish(rank, core.take_events())
            # The disk tier's reads end on its I/O thread: wake the rank, a request may be ready.
            core.set_io_listener(_threadsafe_setter(loop, self._wake[rank]))
        self._tasks = [
            asyncio.create_task(self._step_loop(rank), name=f"mocker-{self.worker_id:x}-dp{rank}")
            for rank in range(len(self.cores))
        ]
        cfg = self.config
        logger.info(
            "mocker started worker_id=%016x dp=%d num_gpu_blocks=%d block_size=%d max_num_seqs=%d "
            "max_num_batched_tokens=%d prefix_caching=%s speedup_ratio=%g",
            self.worker_id, cfg.data_parallel_size, cfg.num_gpu_blocks, cfg.block_size, cfg.max_num_seqs,
            cfg.max_num_batched_tokens, cfg.enable_prefix_caching, cfg.speedup_ratio,
        )

    async def stop(self) -> None:
        if self._status == EngineState.STOPPED:
            return
        self._status = EngineState.STOPPED
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        try:
            # return_exceptions absorbs the tasks' own cancellation only: a caller cancelled while
            # waiting here gets its CancelledError, after the cleanup below.
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._end_all(UnavailableError("mocker engine stopped"))
            for core in self.cores:
                core.abort_all()
                core.set_io_listener(None)
            try:
                # A persistent disk tier finishes its queued block writes: off the event loop.
                await asyncio.to_thread(self._close_cores)
                if self._kv is not None:
                    await self._kv.close()
            finally:
                self._events.close()  # ends kv_events()
        logger.info("mocker stopped worker_id=%016x", self.worker_id)

    def _close_cores(self) -> None:
        for core in self.cores:
            core.close()

    # ---- disaggregation -------------------------------------------------------------------------

    @staticmethod
    def _make_kv_memory(config: MockerConfig, layout: KvLayout) -> KvBlockMemory:
        if layout.block_size != config.block_size:
            raise ConfigError(f"KV layout block size {layout.block_size} is not --block-size {config.block_size}")
        rows = config.num_gpu_blocks * config.data_parallel_size
        try:
            return KvBlockMemory(rows, layout.block_bytes)
        except (MemoryError, ValueError) as exc:
            gib = rows * layout.block_bytes / 2**30
            raise ConfigError(
                f"cannot reserve {gib:.1f} GiB of KV block memory ({rows} blocks of {layout.block_bytes} bytes: "
                f"--num-gpu-blocks x --data-parallel-size, {layout.bytes_per_token} bytes per token x "
                f"--block-size {layout.block_size}): {exc}; lower --num-gpu-blocks or --kv-bytes-per-token"
            ) from exc

    @property
    def kv_layout(self) -> KvLayout | None:
        return self._kv_layout

    def kv_transfer_memory(self) -> KvBlockMemory | None:
        return self._kv_memory

    def attach_kv_transfer(self, ctx: KvTransferContext) -> None:
        """Starts holding prefill results and reading decode requests' KV through ``ctx``."""
        if self._kv_memory is None:
            raise ConfigError("this mocker engine keeps no KV memory (built without a KV layout); it cannot transfer KV")
        if self._kv is not None:
            raise EngineError("a KV transfer agent is already attached")
        self._kv = MockerKvTransfer(
            self.worker_id, self.cores, self._kv_memory, ctx, self._load_done, lambda rank: self._wake[rank].set()
        )
        logger.info(
            "mocker kv transfer attached worker_id=%016x backend=%s block_bytes=%d blocks=%d hold_timeout_s=%g "
            "transfer_timeout_s=%g",
            self.worker_id, ctx.agent.backend, self._kv_memory.block_bytes, self._kv_memory.num_blocks,
            ctx.settings.hold_timeout_s, ctx.settings.transfer_timeout_s,
        )

    def _load_done(self, rank: int, request_id: str, ok: bool, report: dict) -> None:
        """A decode request's read ended: it runs with its KV in place, or prefills here."""
        core = self.cores[rank]
        if core.finish_remote_load(request_id, ok):
            stream = self._active.get(request_id)
            if stream is not None:
                stream.final_params = {REPORT_KEY: report}
                stream.attach_params(stream.final_params)  # also with the first token: route-explain
        marks = self._traced.get(request_id) if self._traced else None
        if marks is not None:
            marks.transferred(report)
        self._publish(rank, core.take_events())
        self._wake[rank].set()

    # ---- requests ------------------------------------------------------------------------------

    def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Streams the request's outputs; the last one has ``finish_reason`` and ``usage``.

        Errors (invalid request, engine asleep) are raised when iteration starts. Closing the
        iterator early aborts the request and frees its blocks.
        """
        return self._generate(request)

    async def _generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        self._check_serving()
        guided = await self._guided_state(request)
        if guided is not None:
            self._check_serving()  # the engine may have gone to sleep while the grammar compiled
        if request.lora_name:
            self._request_lora(request.lora_name)
        self._check_new_request(request.request_id)
        remote = self._remote_params(request)
        rank = self._pick_rank(request)
        core = self.cores[rank]
        # A prefill worker holds the KV for a decode worker; one without a transfer agent has no
        # way to hand it over, so its final output carries no parameters (the frontend then
        # prefills on the decode worker).
        hold = request.prefill_only and self._kv is not None
        core.add_preprocessed(request, remote=remote, hold_kv=hold, guided=guided)
        request_id = request.request_id
        stream = RequestStream(request_id, rank, len(request.token_ids))
        if request.disaggregated_params is not None and remote is None and not request.prefill_only:
            stream.final_params = {REPORT_KEY: {"ok": False, "reason": "this worker has no KV transfer agent"}}
        self._active[request_id] = stream
        span = engine_span(request_id)
        marks = self._traced[request_id] = TraceMarks(span) if span is not None else None
        self._wake[rank].set()
        done = False
        try:
            while True:
                out = await stream.get()
                if marks is not None:
                    marks.output(len(out.token_ids), out.finish_reason)
                if out.finish_reason is not None:
                    done = True
                    yield out
                    return
                yield out
        finally:
            if marks is not None:
                del self._traced[request_id]
                marks.emit()
            if not done:
                if self._active.get(request_id) is stream:
                    del self._active[request_id]
                if core.abort(request_id):
                    self._wake[rank].set()
                    if self._kv is not None:
                        self._kv.cancel_load(request_id)
                        self._kv.stream_aborted(request_id)
                    logger.debug("mocker request aborted request_id=%s dp_rank=%d", request_id, rank)

    async def abort(self, request_id: str) -> None:
        stream = self._active.pop(request_id, None)
        if stream is None:
            return
        self.cores[stream.dp_rank].abort(request_id)
        if self._kv is not None:
            self._kv.cancel_load(request_id)
            self._kv.stream_aborted(request_id)
        self._wake[stream.dp_rank].set()
        stream.finish(FINISH_ABORT, Usage(prompt_tokens=stream.prompt_tokens, completion_tokens=stream.num_tokens))

    async def _guided_state(self, request: PreprocessedRequest) -> GuidedState | None:
        """The grammar state of a request with an output constraint. The first one loads the
        vocabulary, and a new constraint compiles: both in a thread, off the step loops."""
        guided = request.sampling.guided_decoding
        if guided is None:
            return None
        seed = request_seed(request.request_id, request.token_ids, request.sampling.seed) ^ _GUIDED_SEED_SALT
        return await asyncio.to_thread(self._guided_vocab.new_state, guided, seed)

    def _check_serving(self) -> None:
        if self._status == EngineState.READY:
            return
        if self._status == EngineState.SLEEPING:
            raise UnavailableError(f"worker {self.worker_id:x} is asleep (level {self.sleep_level}); wake it up first")
        if self._status == EngineState.STOPPED:
            raise UnavailableError(f"worker {self.worker_id:x} is stopped")
        raise UnavailableError(f"worker {self.worker_id:x} is not started")

    def _remote_params(self, request: PreprocessedRequest) -> KvTransferParams | None:
        """The decode request's transfer parameters when this engine will read their KV."""
        raw = request.disaggregated_params
        if raw is None or request.prefill_only:
            return None
        params = parse_transfer_params(raw)
        if self._kv is None:
            if not self._no_agent_logged:
                self._no_agent_logged = True
                logger.warning(
                    "mocker got transfer params without a transfer agent, prefilling locally worker_id=%016x "
                    "request_id=%s hint=run_decode_workers_with_role_decode",
                    self.worker_id, request.request_id,
                )
            return None
        return params

    def _pick_rank(self, request: PreprocessedRequest) -> int:
        n = len(self.cores)
        if request.dp_rank is not None:
            if not 0 <= request.dp_rank < n:
                raise InvalidRequestError(f"dp_rank {request.dp_rank} out of range [0, {n})", param="dp_rank")
            return request.dp_rank
        if n == 1:
            return 0
        # vLLM's DP coordinator balances on queue lengths, waiting counted four times.
        best, best_score = 0, None
        for rank, core in enumerate(self.cores):
            sched = core.scheduler
            score = 4 * len(sched.waiting) + len(sched.running)
            if best_score is None or score < best_score:
                best, best_score = rank, score
        return best

    # ---- the step loop -------------------------------------------------------------------------

    async def _step_loop(self, rank: int) -> None:
        core = self.cores[rank]
        wake = self._wake[rank]
        stats = self._stats[rank]
        loop = asyncio.get_running_loop()
        scale = 1.0 / (1000.0 * self.config.speedup_ratio)
        deadline = last_yield = loop.time()
        while True:
            if not core.has_unfinished_requests():
                wake.clear()
                idle_from = loop.time()
                await wake.wait()
                deadline = last_yield = loop.time()
                stats.idle_s += deadline - idle_from
                continue
            try:
                out = core.step()
            except Exception as exc:  # a bug in the core must not kill the worker silently
                logger.exception("mocker step failed worker_id=%016x dp_rank=%d", self.worker_id, rank)
                self._fail_rank(rank, EngineError(f"mocker step failed: {exc}"))
                continue
            if out.kv_events:
                self._publish(rank, out.kv_events)
            if out.remote_loads is not None and self._kv is not None:
                self._kv.start_loads(rank, out.remote_loads)
            if out.streams_opened is not None or out.streams_failed is not None:
                self._streams_changed(rank, out)  # now: the decode is dispatched while this step computes
            if not out.req_ids and not out.duration_ms:
                # Nothing could run: every request waits for its KV from a prefill worker, or
                # held blocks leave no room for the head request. Wait for a read to end, a hold
                # to be released, an arrival or an abort instead of spinning.
                wake.clear()
                await wake.wait()
                deadline = last_yield = loop.time()
                continue
            deadline += out.duration_ms * scale
            now = loop.time()
            delay = deadline - now
            if delay > _TIMER_SLACK_S:
                await asyncio.sleep(delay)
                now = last_yield = loop.time()
                lag = max(now - deadline, 0.0)
            else:
                lag = -delay if delay < 0.0 else 0.0
                if lag > _MAX_LAG_S:
                    stats.clock_resets += 1
                    deadline = now
                if now - last_yield > _MAX_BUSY_S:
                    await asyncio.sleep(0)
                    last_yield = loop.time()
            stats.steps += 1
            stats.simulated_ms += out.duration_ms
            stats.lag_sum_s += lag
            if lag > stats.lag_max_s:
                stats.lag_max_s = lag
            self._deliver(rank, out)

    def _streams_changed(self, rank: int, out: StepOutput) -> None:
        """Streamed holds admitted this step send their transfer parameters at once; preempted
        ones fail their readers."""
        kv = self._kv
        assert kv is not None, "streamed holds without a transfer agent"
        for tid, reason in out.streams_failed or ():
            kv.stream_failed(tid, reason)
        for hold in out.streams_opened or ():
            params = kv.stream_opened(rank, hold)
            stream = self._active.get(hold.request_id)
            if stream is not None:
                stream.push_params(params)

    def _deliver(self, rank: int, out: StepOutput) -> None:
        streams = self._active
        if out.prefill_progress and self._kv is not None and self._kv.streaming:
            self._kv.progress(out.prefill_progress)  # the chunks just computed are ready to read
        if self._traced and out.prefill_progress:
            # The step that first computes a traced prompt ends its queue wait (at the step's start).
            start = time.time_ns() - int(out.duration_ms * 1e6 / self.config.speedup_ratio)
            for request_id, _, _ in out.prefill_progress:
                marks = self._traced.get(request_id)
                if marks is not None:
                    marks.scheduled(start)
        for request_id, token in zip(out.req_ids, out.token_ids, strict=True):
            stream = streams.get(request_id)
            if stream is not None:
                stream.push(token)
        for request_id, logprob, top in out.logprobs:
            stream = streams.get(request_id)
            if stream is not None:
                stream.push_logprob(logprob, top)
        for fin in out.finished:
            stream = streams.pop(fin.request_id, None)
            if fin.hold is not None:
                kv = self._kv
                assert kv is not None, "a held request without a transfer agent"
                params = kv.hold_created(rank, fin.hold)
                if stream is None:  # nobody will hand the parameters to a decode worker
                    kv.release(params["transfer_id"])
                else:
                    stream.final_params = params
            if stream is not None:
                stream.finish(fin.finish_reason, fin.usage)

    def _fail_rank(self, rank: int, exc: BaseException) -> None:
        for request_id in self.cores[rank].abort_all():
            stream = self._active.pop(request_id, None)
            if stream is not None:
                stream.fail(exc)
            if self._kv is not None:
                self._kv.stream_aborted(request_id)

    def _end_all(self, exc: BaseException | None) -> None:
        """Ends every in-flight stream: with ``exc``, or as aborted when None."""
        streams, self._active = self._active, {}
        for stream in streams.values():
            if exc is None:
                stream.finish(FINISH_ABORT, Usage(prompt_tokens=stream.prompt_tokens, completion_tokens=stream.num_tokens))
            else:
                stream.fail(exc)

    def loop_stats(self) -> list[LoopStats]:
        """Per-rank pacing statistics (benchmarks, diagnostics)."""
        return list(self._stats)

    # ---- KV events -----------------------------------------------------------------------------

    def _publish(self, rank: int, events: list[KvEvent]) -> None:
        # A full queue drops (and ``_event_id`` still advances): the gap makes the router re-read
        # this worker through kv_dump, which is the designed recovery.
        offer = self._events.offer
        for event in events:
            self._event_id += 1
            offer(RouterEvent(worker_id=self.worker_id, dp_rank=rank, event_id=self._event_id, event=event))

    def kv_events(self) -> AsyncIterator[RouterEvent]:
        """The KV events of every rank in order (one consumer); ends when the engine stops."""
        return self._events.stream()

    @property
    def events_dropped(self) -> int:
        return self._events.dropped

    @property
    def last_event_id(self) -> int:
        return self._event_id

    async def kv_dump(self) -> list[RouterEvent]:
        """Every cached block as stored events, parents first. Their ``event_id`` is the id of the
        last event published before the dump, so a reader resumes the stream after it."""
        out = []
        for rank, core in enumerate(self.cores):
            for stored in core.kv_dump():
                out.append(RouterEvent(worker_id=self.worker_id, dp_rank=rank, event_id=self._event_id, event=stored))
        return out

    async def clear_kv_blocks(self, medium: str | None = None) -> int:
        """Drops the cached blocks of one KV tier (``medium``: GPU, CPU, DISK) or of every tier
        (None). Clearing the device cache drops every hold too (a decode worker still to read one
        finds other bytes, fails its checksum and prefills locally)."""
        dropped = 0
        for rank, core in enumerate(self.cores):
            dropped += core.clear_kv_blocks(medium)
            self._publish(rank, core.take_events())
        if self._kv is not None:
            self._kv.forget_released()
        logger.info("mocker kv cleared worker_id=%016x medium=%s blocks=%d", self.worker_id, medium or "all", dropped)
        return dropped

    # ---- load ----------------------------------------------------------------------------------

    def load_metrics(self) -> list[LoadMetrics]:
        now = time.time()
        status = self._status
        out = []
        for rank, core in enumerate(self.cores):
            load = core.load()
            out.append(
                LoadMetrics(
                    worker_id=self.worker_id,
                    dp_rank=rank,
                    active_decode_blocks=load.active_blocks,
                    active_prefill_tokens=load.active_prefill_tokens,
                    kv_usage=load.kv_usage,
                    total_blocks=load.total_blocks,
                    num_waiting=load.num_waiting,
                    num_running=load.num_running,
                    prefix_hit_rate=load.prefix_hit_rate,
                    status=status,
                    ts=now,
                    kv_held_blocks=load.held_blocks,
                    kv_tiers=_tier_metrics(load),
                )
            )
        if self._kv is not None:
            # Worker-wide figures go on rank 0 only, so a reader summing the ranks counts them once.
            stats = self._kv.ctx.stats
            p50, p99 = stats.percentiles_ms()
            first = out[0]
            first.kv_transfer_bytes = stats.bytes_total
            first.kv_transfers = stats.transfers
            first.kv_transfer_failures = stats.failures
            first.kv_transfer_ms_p50 = round(p50, 3)
            first.kv_transfer_ms_p99 = round(p99, 3)
        return out

    # ---- sleep / wake --------------------------------------------------------------------------

    async def sleep(self, level: int) -> None:
        """Level 1 aborts in-flight requests and drops the KV cache; level 2 also releases the
        (simulated) weights. ``generate`` is refused until ``wake_up``."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}", param="level")
        if self._status == EngineState.STOPPED:
            raise UnavailableError(f"worker {self.worker_id:x} is stopped")
        if self._status == EngineState.SLEEPING:
            self.sleep_level = max(self.sleep_level, level)
            return
        self._status = EngineState.SLEEPING
        self.sleep_level = level
        aborted = len(self._active)
        self._end_all(None)
        dropped = 0
        for core in self.cores:
            core.abort_all()
        if self._kv is not None:
            await self._kv.abort_loads()
        for rank, core in enumerate(self.cores):
            # Device memory only: the host and disk tiers are not the engine's to release.
            dropped += core.clear_kv_blocks(MEDIUM_GPU)
            self._publish(rank, core.take_events())
        if self._kv is not None:
            self._kv.forget_released()
        logger.info(
            "mocker asleep worker_id=%016x level=%d aborted=%d kv_blocks_dropped=%d",
            self.worker_id, level, aborted, dropped,
        )

    async def wake_up(self) -> None:
        if self._status == EngineState.STOPPED:
            raise UnavailableError(f"worker {self.worker_id:x} is stopped")
        if self._status != EngineState.SLEEPING:
            return
        level, self.sleep_level = self.sleep_level, 0
        self._status = EngineState.READY if self._tasks else EngineState.CREATED
        logger.info("mocker awake worker_id=%016x from_level=%d", self.worker_id, level)

    # ---- LoRA ----------------------------------------------------------------------------------

    async def load_lora(self, name: str, source: str) -> LoraInfo:
        if not name:
            raise InvalidRequestError("lora_name must not be empty", param="lora_name")
        existing = self._loaded_lora(name, source)
        if existing is not None:
            return existing
        info = self._new_lora(name, source)
        self._loras[name] = info
        logger.info("mocker lora loaded worker_id=%016x lora=%s lora_id=%d source=%s", self.worker_id, name, info.lora_id, source)
        return info

    async def unload_lora(self, name: str) -> None:
        if self._loras.pop(name, None) is None:
            raise self._unknown_lora(name)
        logger.info("mocker lora unloaded worker_id=%016x lora=%s", self.worker_id, name)

def _threadsafe_setter(loop: asyncio.AbstractEventLoop, event: asyncio.Event):
    """A callable for another thread that sets ``event`` on ``loop`` (ignored once the loop closed)."""

    def set_event() -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    return set_event


def _tier_metrics(load: CoreLoad) -> dict[str, KvTierLoad] | None:
    if not load.tiers:
        return None
    return {
        medium: KvTierLoad(
            blocks=t.blocks, total_blocks=t.capacity, usage=round(t.usage, 4), hit_tokens=t.hit_tokens,
            onboarded_blocks=t.onboarded_blocks, offloaded_blocks=t.offloaded_blocks,
        )
        for medium, t in load.tiers.items()
    }
