"""``MockerCore``: one simulated engine (one data-parallel rank), synchronous and clock-free.

It holds the whole state (scheduler, KV cache, requests) and advances it one engine step per
``step()`` call, returning what the step produced and how long it would have taken on the GPU.
It never sleeps, reads a clock or touches asyncio, so the async ``MockerEngine`` can pace it in
real time while a trace replayer drives many cores on a simulated clock as fast as the CPU allows.

Disaggregation (only when the core is given a ``KvBlockMemory``, i.e. on a prefill or decode
worker; an aggregated core keeps no KV bytes and pays nothing): the core writes each block's bytes
as it computes them (``kv_content``), so a transfer moves real, checkable bytes. A prefill request
(``hold_kv``) ends in a ``KvHold`` that keeps its blocks until ``release_hold``; a decode request
with ``remote`` parameters waits for its read (``StepOutput.remote_loads``, then
``finish_remote_load``). Reads, notifications and expiry deadlines are the engine's: the core only
keeps the state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dynamod.daemon.engines.mocker.block_pool import KVBlock
from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.disk_tier import DiskStore
from dynamod.daemon.engines.mocker.encoder import encode_time_ms, image_tokens_to_encode
from dynamod.daemon.engines.mocker.guided import GuidedState
from dynamod.daemon.engines.mocker.kv_content import KvContentWriter
from dynamod.daemon.engines.mocker.kv_manager import KVCacheManager
from dynamod.daemon.engines.mocker.request import MockRequest, RemoteKv
from dynamod.daemon.engines.mocker.sampling import TokenSampler, needs_sampler
from dynamod.daemon.engines.mocker.scheduler import (
    NO_DECODE_STRETCH,
    DecodeStretch,
    PromptHasher,
    Scheduler,
    SchedulerOutput,
)
from dynamod.daemon.engines.mocker.tiers import TierBandwidth, TieredKvCache
from dynamod.daemon.perf.mocker_timing import decode_time_ms, prefill_time_ms
from dynamod.shared.errors import ContextLengthError, InvalidRequestError
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.kv_events import (
    MEDIA,
    MEDIUM_GPU,
    KvEvent,
    KvStored,
    StoredBlock,
)
from dynamod.shared.protocol.kv_transfer import KvLayout, KvTransferParams
from dynamod.shared.protocol.llm import (
    FINISH_ERROR,
    MultimodalItem,
    PrefixPin,
    PreprocessedRequest,
    SamplingOptions,
    Usage,
    engine_priority,
)


@dataclass(slots=True)
class KvHold:
    """A finished prefill request's blocks, kept for a decode worker to read.

    ``block_ids`` are memory rows (``row_offset + block id``: what a peer reads); ``block_hashes``
    the router's sequence hashes of the full ones."""

    transfer_id: str
    request_id: str
    blocks: list[KVBlock]
    block_ids: list[int]
    block_hashes: list[int]
    num_tokens: int
    cached_tokens: int
    first_token: int


@dataclass(slots=True)
class RemoteLoad:
    """A decode request admitted to wait for its prompt's KV: read ``params.block_ids[i]`` into
    ``local_block_ids[i]`` (rows) for every ``i >= num_local_hits`` (the leading blocks this
    worker already caches need no read)."""

    request_id: str
    params: KvTransferParams
    num_tokens: int  # the prompt's
    local_block_ids: list[int]
    num_local_hits: int


@dataclass(slots=True)
class FinishedRequest:
    request_id: str
    finish_reason: str  # "stop" | "length"
    usage: Usage
    num_preemptions: int = 0
    hold: KvHold | None = None  # a prefill request's blocks, held for a decode worker


@dataclass(slots=True)
class StepOutput:
    """The result of one engine step.

    ``req_ids``/``token_ids`` are parallel: the token each request produced this step (at most one
    per request). ``duration_ms`` is the simulated step time before ``--speedup-ratio``.
    """

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    duration_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    onboard_ms: float = 0.0  # prefix blocks copied back from the host/disk tiers
    encode_ms: float = 0.0  # the vision encoder over this step's new images (encoder.py)
    num_encoded_image_tokens: int = 0
    num_prefill_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    num_preempted: int = 0
    kv_usage: float = 0.0
    kv_events: list[KvEvent] = field(default_factory=list)
    remote_loads: list[RemoteLoad] | None = None  # reads the engine must start
    # (request id, prompt tokens computed before this step, after it) for each request this step
    # prefilled: which of a prompt's blocks are ready for a decode worker to read as each chunk
    # ends (chunk-wise KV transfer overlapped with the prefill). Tokens before the first figure
    # were ready when the step began (the prefix cache's hits), those up to the second at its end.
    prefill_progress: list[tuple[str, int, int]] = field(default_factory=list)
    # Streamed holds (``enable_hold_streaming``): held prefill requests admitted this step, whose
    # rows the engine hands out before the prefill ends, and those preempted (transfer id,
    # reason), whose rows will never hold their KV.
    streams_opened: list[KvHold] | None = None
    streams_failed: list[tuple[str, str]] | None = None
    # (request id, logprob, top alternatives) for the tokens of requests that asked for them.
    logprobs: list[tuple[str, float, list[tuple[int, float]] | None]] = field(default_factory=list)


@dataclass(slots=True)
class CoreLoad:
    """Load of one core, as the router and the planner want it."""

    num_waiting: int
    num_running: int
    active_blocks: int  # blocks held by requests
    total_blocks: int
    kv_usage: float
    active_prefill_tokens: int  # prompt tokens admitted but not yet prefilled
    prefix_hit_rate: float  # cached prompt tokens / prompt tokens, since start
    held_blocks: int = 0  # blocks held for decode workers to read (prefill)
    num_loading: int = 0  # requests waiting for their KV from a prefill worker (decode)
    tiers: dict[str, TierLoad] | None = None  # lower KV tiers by medium (CPU, DISK), when configured


@dataclass(slots=True)
class TierLoad:
    """One lower KV tier of one core: occupancy and cumulative traffic (blocks) since start."""

    blocks: int
    capacity: int
    hit_tokens: int  # prompt tokens onboarded from this tier instead of recomputed
    onboarded_blocks: int
    offloaded_blocks: int

    @property
    def usage(self) -> float:
        return self.blocks / self.capacity if self.capacity else 0.0


class MockerCore:
    """One engine's state. Not thread-safe; one owner calls it."""

    def __init__(
        self,
        config: MockerConfig,
        dp_rank: int = 0,
        *,
        kv_memory: KvBlockMemory | None = None,
        kv_layout: KvLayout | None = None,
        prompt_hasher: PromptHasher | None = None,
    ) -> None:
        """``prompt_hasher``: where an admitted request's prompt hashes come from, for a caller
        that has them already (a trace replay hashes each prompt once for its routers and every
        core that admits it); it must give what ``MockRequest.hash_prompt`` would."""
        self.config = config
        self.dp_rank = dp_rank
        self.kv_manager = KVCacheManager(
            config.num_gpu_blocks, config.block_size, config.enable_prefix_caching, config.max_pinned_fraction
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            watermark_blocks=config.watermark_blocks,
            context_length=config.context_length,
            prompt_hasher=prompt_hasher,
            policy=config.scheduling_policy,
        )
        self._eos = frozenset(config.eos_token_ids)
        self.num_steps = 0
        self.simulated_ms = 0.0  # sum of step durations so far (before speedup)
        # This rank's blocks are rows [row_offset, row_offset + num_gpu_blocks) of the memory.
        self.row_offset = dp_rank * config.num_gpu_blocks
        self.kv_writer: KvContentWriter | None = None
        if kv_memory is not None:
            if kv_layout is None or kv_layout.block_size != config.block_size:
                raise ValueError(f"KV memory needs a layout with block_size {config.block_size}, got {kv_layout}")
            if kv_memory.num_blocks < self.row_offset + config.num_gpu_blocks:
                raise ValueError(f"KV memory of {kv_memory.num_blocks} blocks does not hold rank {dp_rank}'s blocks")
            self.kv_writer = KvContentWriter(kv_memory, kv_layout, self.row_offset)
        self.tiers: TieredKvCache | None = None
        if config.has_lower_tiers:
            self.tiers = self._make_tiers(config, kv_memory, kv_layout)
            self.kv_manager.attach_tiers(self.tiers)
        self.holds: dict[str, KvHold] = {}
        self._streams: dict[str, str] = {}  # request id -> transfer id of a held prefill still running
        self.streams_holds = False
        self.num_held_blocks = 0
        self.hold_id_prefix = f"dp{dp_rank}-"  # the engine makes it unique per worker
        self._next_hold = 0

    def _make_tiers(self, config: MockerConfig, memory: KvBlockMemory | None, layout: KvLayout | None) -> TieredKvCache:
        """Host and disk tiers; with KV memory they move the blocks' bytes (the disk tier in files
        under ``disk_cache_dir/dp{rank}``), without it they keep the index and the timing only."""
        bandwidth = TierBandwidth(
            d2h_gbps=config.host_offload_d2h_bandwidth_gbps,
            h2d_gbps=config.host_offload_h2d_bandwidth_gbps,
            disk_write_gbps=config.disk_offload_write_bandwidth_gbps,
            disk_read_gbps=config.disk_offload_read_bandwidth_gbps,
        )
        if memory is None or layout is None:
            return TieredKvCache(
                num_host_blocks=config.num_host_blocks, num_disk_blocks=config.num_disk_blocks,
                block_bytes=config.kv_bytes_per_token * config.block_size, bandwidth=bandwidth,
            )
        rows = memory.array
        offset = self.row_offset

        def read_row(block_id: int) -> np.ndarray:
            return rows[offset + block_id]

        def write_row(block_id: int, data: np.ndarray) -> None:
            rows[offset + block_id] = data

        store = None
        if config.num_disk_blocks:
            store = DiskStore(Path(config.disk_cache_dir) / f"dp{self.dp_rank}", layout.block_bytes,
                              persist=config.disk_cache_persist)
        return TieredKvCache(
            num_host_blocks=config.num_host_blocks, num_disk_blocks=config.num_disk_blocks,
            block_bytes=layout.block_bytes, bandwidth=bandwidth, disk_store=store,
            read_row=read_row, write_row=write_row, disk_io_queue_blocks=config.disk_io_queue_blocks,
            io_thread_name=f"dynamod-kv-disk-dp{self.dp_rank}",
        )

    def close(self) -> None:
        """Releases what outlives the process otherwise: the disk tier's I/O thread and files
        (a persistent tier finishes its queued writes first; otherwise they are dropped and the
        files removed). Blocks for as long as that takes."""
        if self.tiers is not None:
            self.tiers.close()

    # ---- disk tier I/O -------------------------------------------------------------------------

    def set_io_listener(self, listener: Callable[[], None] | None) -> None:
        """``listener`` is called on the disk tier's I/O thread whenever a read or write ends (the
        engine wakes this rank's step loop with it: a request may have stopped waiting)."""
        if self.tiers is not None and self.tiers.io is not None:
            self.tiers.io.on_complete = listener

    @property
    def io_pending(self) -> int:
        """Disk-tier reads and writes not yet taken in by a step."""
        return self.tiers.io_pending if self.tiers is not None else 0

    def wait_for_io(self, timeout: float) -> bool:
        """Blocks until some disk-tier I/O ended (or none is in flight), for a synchronous driver
        whose ``step()`` found nothing to run while requests wait for block files; False on
        timeout."""
        return self.tiers.wait_io(timeout) if self.tiers is not None else True

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        seed: int | None = None,
        lora_name: str | None = None,
        kv_transferred: bool = False,
        remote: KvTransferParams | None = None,
        hold_kv: bool = False,
        sampling: SamplingOptions | None = None,
        guided: GuidedState | None = None,
        check_tokens: bool = True,
        priority: int = 0,
        pin: PrefixPin | None = None,
        mm_items: list[MultimodalItem] | None = None,
    ) -> None:
        """Queues a request. Raises ``InvalidRequestError`` (``ContextLengthError`` for length).

        ``sampling``: options beyond the seed (log-probabilities, logit bias, penalties, ...);
        with any the LCG cannot honour, the request samples through a ``TokenSampler``, under
        ``guided``'s grammar when it has an output constraint (the engine compiles it, off the
        step loop).

        ``kv_transferred``: the prompt's KV is taken as present at no compute (trace replay, which
        models the transfer itself). ``remote``: the prompt's KV is to be read from the prefill
        worker these parameters name (the engine does the read). ``hold_kv``: keep the blocks
        when the request finishes (``FinishedRequest.hold``), for a decode worker to read.

        ``check_tokens=False`` skips the scan of every prompt token against the vocabulary, for a
        caller whose token ids are in range by construction: a trace replayer checks each trace
        block once, where scanning 145 million prompt tokens here would cost seconds.

        ``priority``: in the engine's convention (lower first), used under the priority policy;
        ``add_preprocessed`` converts the request's Dynamo priority to it.

        ``mm_items``: the prompt's images (``MultimodalItem``): their content keys the blocks that
        cover them, and the step that first prefills an image's tokens pays the encoder (encoder.py).

        ``pin``: keep the prompt's prefix cached for a while (``cache_control``; kv_manager.py)."""
        # ``MockRequest`` copies the prompt; a list is only read here (a replay's prompts are
        # thousands of tokens: one copy per admission, not two).
        prompt = prompt_token_ids if type(prompt_token_ids) is list else list(prompt_token_ids)
        max_out = self.check_request(request_id, prompt, max_tokens, min_tokens, check_tokens=check_tokens)
        stop = frozenset(stop_token_ids)
        if not ignore_eos:
            stop = stop | self._eos
        if min_tokens > 0 and sum(1 for t in stop if 0 <= t < self.config.vocab_size) >= self.config.vocab_size:
            raise InvalidRequestError("min_tokens > 0 but every token of the vocabulary is a stop token", param="min_tokens")
        request = MockRequest(
            request_id,
            prompt,
            max_output_tokens=max_out,
            vocab_size=self.config.vocab_size,
            min_tokens=min_tokens,
            stop_ids=stop,
            lora_name=lora_name,
            seed=seed,
            kv_transferred=kv_transferred,
            priority=priority,
        )
        if remote is not None:
            request.remote = RemoteKv(remote)
        request.hold_kv = hold_kv
        request.pin = pin
        request.mm_items = mm_items or None  # before hashing: the images key their blocks
        if guided is not None or (sampling is not None and needs_sampler(sampling)):
            request.sampler = TokenSampler(
                sampling or SamplingOptions(),
                vocab_size=self.config.vocab_size,
                seed=request.rng_state,
                prompt_token_ids=prompt,
                ignore_eos=ignore_eos,
                guided=guided,
            )
        self.scheduler.add_request(request)

    def add_preprocessed(
        self,
        request: PreprocessedRequest,
        *,
        remote: KvTransferParams | None = None,
        hold_kv: bool = False,
        guided: GuidedState | None = None,
    ) -> None:
        """``add_request`` from the ``generate`` endpoint's wire type. The request's
        ``disaggregated_params`` are the engine's to interpret: it passes ``remote`` when it will
        read the KV they name; without it the prompt is prefilled here."""
        stop = request.stop
        max_tokens = 1 if request.prefill_only else stop.max_tokens
        self.add_request(
            request.request_id,
            request.token_ids,
            max_tokens=max_tokens,
            min_tokens=0 if request.prefill_only else (stop.min_tokens or 0),
            stop_token_ids=stop.stop_token_ids,
            ignore_eos=stop.ignore_eos or request.prefill_only,
            seed=request.sampling.seed,
            lora_name=request.lora_name,
            remote=remote,
            hold_kv=hold_kv,
            sampling=request.sampling,
            guided=guided,
            priority=engine_priority(request.priority),
            pin=request.pin,
            mm_items=request.mm_items,
        )

    def check_request(
        self, request_id: str, prompt: list[int], max_tokens: int | None, min_tokens: int, *, check_tokens: bool = True
    ) -> int:
        """Validates a request as vLLM's frontend does; returns its output token limit."""
        cfg = self.config
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        n = len(prompt)
        if n == 0:
            raise InvalidRequestError("the prompt is empty; it needs at least one token", param="prompt")
        lo, hi = (min(prompt), max(prompt)) if check_tokens else (0, 0)
        if lo < 0 or hi >= cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidRequestError(
                f"token id {bad} is out of vocabulary (size {cfg.vocab_size})", param="prompt"
            )
        if n >= cfg.context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {cfg.context_length} tokens. However, your "
                f"prompt has {n} tokens, leaving no room for output.",
                param="prompt",
            )
        if max_tokens is None:
            max_tokens = cfg.context_length - n
        elif max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        elif n + max_tokens > cfg.context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {cfg.context_length} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion).",
                param="max_tokens",
            )
        if min_tokens < 0 or min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", param="min_tokens"
            )
        return max_tokens

    def abort(self, request_id: str) -> bool:
        """Drops a request and frees its blocks. False if it is unknown or already finished."""
        self._streams.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def abort_all(self) -> list[str]:
        """Aborts every request (sleep, stop); returns their ids."""
        ids = list(self.scheduler.requests)
        for request_id in ids:
            self.scheduler.abort(request_id)
        self._streams.clear()
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---- stepping ------------------------------------------------------------------------------

    def step(self, admit: bool = True) -> StepOutput:
        """Runs one engine step: schedule, "compute" (timing model), sample, finish.
        ``admit=False``: waiting requests stay waiting (``Scheduler.schedule``)."""
        sched = self.scheduler.schedule(admit)
        out = StepOutput()
        kv_usage = self.kv_manager.usage  # after this step's allocations, before finished free
        out.kv_usage = kv_usage
        out.num_prefill_tokens = sched.num_prefill_tokens
        out.num_prefill_reqs = len(sched.prefill_reqs)
        out.num_decode_reqs = len(sched.decode_reqs)
        out.num_preempted = len(sched.preempted_reqs)
        if sched.num_prefill_tokens:
            out.prefill_ms = prefill_time_ms(sched.num_prefill_tokens)
        if sched.decode_reqs:
            out.decode_ms = decode_time_ms(self._attended_kv_fraction(kv_usage))
        if sched.prefill_reqs:
            image_tokens = image_tokens_to_encode(sched.prefill_reqs, sched.prefill_num_tokens)
            if image_tokens:
                out.num_encoded_image_tokens = image_tokens
                out.encode_ms = encode_time_ms(image_tokens, self.config.encode_ms_per_image_token)
        out.duration_ms = out.encode_ms + out.prefill_ms + out.decode_ms
        if sched.onboard_ms:
            out.onboard_ms = sched.onboard_ms
            out.duration_ms += sched.onboard_ms
        if self.kv_writer is not None:
            self._write_kv(sched)
        if sched.remote_loads is not None:
            out.remote_loads = [self._remote_load(request) for request in sched.remote_loads]
        if self.streams_holds:
            self._track_streams(sched, out)
        if sched.prefill_reqs:
            out.prefill_progress = [
                (request.request_id, request.num_computed_tokens, request.num_computed_tokens + num_new)
                for request, num_new in zip(sched.prefill_reqs, sched.prefill_num_tokens, strict=True)
            ]
        result = self.scheduler.update_from_output(sched)
        out.req_ids = result.req_ids
        out.token_ids = result.token_ids
        out.logprobs = result.logprobs
        for request in result.finished:
            out.finished.append(
                FinishedRequest(
                    request.request_id,
                    request.finish_reason or "stop",
                    Usage(
                        prompt_tokens=request.num_prompt_tokens,
                        cached_tokens=max(request.num_cached_tokens, 0),
                        completion_tokens=request.num_output_tokens,
                        pinned_tokens=request.num_pinned_tokens,
                        pin_refused=request.pin_refused,
                    ),
                    request.num_preemptions,
                    self._hold(request) if request.hold_kv and request.finish_reason != FINISH_ERROR else None,
                )
            )
        out.kv_events = self.kv_manager.take_events()
        self.num_steps += 1
        self.simulated_ms += out.duration_ms
        return out

    def _attended_kv_fraction(self, kv_usage: float) -> float:
        """The KV occupancy a decode step's time follows: the blocks in use less those held only
        for requests still waiting for their KV from a prefill worker (allocated at admission,
        their bytes not landed, attended by no step). A trace replay adds such a request when
        its transfer ends, so this keeps a live decode worker's step time what replay models."""
        scheduler = self.scheduler
        if not scheduler.num_loading:
            return kv_usage
        return max(kv_usage - scheduler.num_loading_only_blocks() / self.kv_manager.block_pool.num_blocks, 0.0)

    def decode_stretch(self) -> DecodeStretch:
        """The coming ``step()`` calls that would only give each running request one token, with no
        block, queue or load change, no KV event and no finish (``Scheduler.decode_stretch``), and
        whether the one after them only fills a block besides.

        A trace replayer advances such a stretch in one ``run_plain_decode_steps`` call instead of
        one ``step()`` per token: most steps of a long replay are these. Nothing on a core that
        writes KV bytes (disaggregation), where a decode step may have bytes to write."""
        if self.kv_writer is not None:
            return NO_DECODE_STRETCH
        return self.scheduler.decode_stretch()

    def plain_decode_step_ms(self) -> float:
        """The simulated duration of each plain decode step: they hold the same blocks, so the
        timing model gives every one of them the same time."""
        return 0.0 + decode_time_ms(self.kv_manager.usage)  # as step(): prefill_ms (0) + decode_ms

    def run_plain_decode_steps(self, num_steps: int) -> list[str]:
        """Runs ``num_steps`` plain decode steps at once; the state afterwards (tokens, progress,
        ``num_steps``, ``simulated_ms``) is what that many ``step()`` calls give. ``num_steps`` is
        at most ``decode_stretch().plain`` as it was when the first of them began: requests added
        since wait in the queue and join the step after. Returns the ids of the running requests,
        each of which produced one token in every one of the steps."""
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        step_ms = self.plain_decode_step_ms()
        requests = self.scheduler.run_plain_decode_steps(num_steps)
        self.num_steps += num_steps
        for _ in range(num_steps):  # added one at a time, as step() does, so the sum is the same
            self.simulated_ms += step_ms
        return [request.request_id for request in requests]

    def take_events(self) -> list[KvEvent]:
        """KV events produced outside ``step()`` (``clear_kv_blocks``, ``finish_remote_load``)."""
        return self.kv_manager.take_events()

    # ---- disaggregation ------------------------------------------------------------------------

    def _write_kv(self, sched: SchedulerOutput) -> None:
        """Writes the bytes of what this step computes: prefill chunks, and the blocks decode
        tokens complete (a decode's partial tail is never read: only prompt blocks are sent)."""
        writer = self.kv_writer
        assert writer is not None
        for request, num_new in zip(sched.prefill_reqs, sched.prefill_num_tokens, strict=True):
            if not request.kv_transferred:
                start = request.num_computed_tokens
                writer.write(request, start, start + num_new)
        bs = self.config.block_size
        for request in sched.decode_reqs:
            pos = request.num_computed_tokens
            if (pos + 1) % bs == 0:
                writer.write(request, pos, pos + 1)

    def enable_hold_streaming(self) -> None:
        """Held prefill requests get their whole prompt's blocks at admission and are reported
        in ``StepOutput.streams_opened``, so their rows can be read while they are computed."""
        self.streams_holds = True
        self.scheduler.allocate_holds_whole = True

    def _track_streams(self, sched: SchedulerOutput, out: StepOutput) -> None:
        streams = self._streams
        for request in sched.preempted_reqs:
            tid = streams.pop(request.request_id, None)
            if tid is not None:
                # Its blocks are gone: the rows handed out will never hold its KV. It is
                # recomputed as a plain prefill (nobody reads a hold made later).
                request.hold_kv = False
                if out.streams_failed is None:
                    out.streams_failed = []
                out.streams_failed.append((tid, "its prefill was preempted on the prefill worker"))
        for request in sched.prefill_reqs:
            if request.hold_kv and request.request_id not in streams:
                if out.streams_opened is None:
                    out.streams_opened = []
                out.streams_opened.append(self._open_stream(request))

    def _open_stream(self, request: MockRequest) -> KvHold:
        """The hold a streamed prefill will end in, described at admission (no blocks moved yet:
        they stay the request's until it finishes)."""
        bs = self.config.block_size
        n = request.num_prompt_tokens
        assert len(request.blocks) * bs >= n, "a streamed hold is admitted with its whole prompt's blocks"
        request.ensure_block_hashes(n // bs, bs)
        transfer_id = f"{self.hold_id_prefix}{self._next_hold}"
        self._next_hold += 1
        self._streams[request.request_id] = transfer_id
        offset = self.row_offset
        return KvHold(
            transfer_id=transfer_id,
            request_id=request.request_id,
            blocks=[],
            block_ids=[offset + b.block_id for b in request.blocks[: -(-n // bs)]],
            block_hashes=request.block_hashes[: n // bs],
            num_tokens=n,
            cached_tokens=request.num_computed_tokens,
            first_token=-1,
        )

    def _hold(self, request: MockRequest) -> KvHold:
        """Moves a finished prefill request's blocks to a hold (they stay referenced); a streamed
        one keeps the transfer id its rows were handed out under."""
        bs = self.config.block_size
        n = request.num_prompt_tokens
        request.ensure_block_hashes(n // bs, bs)
        blocks, request.blocks = request.blocks, []
        request.num_cached_blocks = 0
        transfer_id = self._streams.pop(request.request_id, None)
        if transfer_id is None:
            transfer_id = f"{self.hold_id_prefix}{self._next_hold}"
            self._next_hold += 1
        offset = self.row_offset
        hold = KvHold(
            transfer_id=transfer_id,
            request_id=request.request_id,
            blocks=blocks,
            block_ids=[offset + b.block_id for b in blocks],
            block_hashes=request.block_hashes[: n // bs],
            num_tokens=n,
            cached_tokens=max(request.num_cached_tokens, 0),
            first_token=request.token_ids[n],
        )
        self.holds[transfer_id] = hold
        self.num_held_blocks += len(blocks)
        return hold

    def release_hold(self, transfer_id: str) -> KvHold | None:
        """Frees a hold's blocks (the decode worker read them, or the hold expired); None if
        there is no such hold (already released)."""
        hold = self.holds.pop(transfer_id, None)
        if hold is None:
            return None
        self.kv_manager.block_pool.free_blocks(reversed(hold.blocks))
        self.num_held_blocks -= len(hold.blocks)
        hold.blocks = []
        return hold

    def release_all_holds(self) -> list[KvHold]:
        return [h for h in (self.release_hold(tid) for tid in list(self.holds)) if h is not None]

    def _remote_load(self, request: MockRequest) -> RemoteLoad:
        remote = request.remote
        assert remote is not None
        offset = self.row_offset
        return RemoteLoad(
            request_id=request.request_id,
            params=remote.params,
            num_tokens=request.num_tokens,
            local_block_ids=[offset + b.block_id for b in request.blocks],
            num_local_hits=remote.local_hit_blocks,
        )

    def finish_remote_load(self, request_id: str, ok: bool) -> bool:
        """Ends a request's wait for its KV (``ok``: every block arrived intact; else it is
        prefilled here). False if it was aborted meanwhile (its blocks are freed now)."""
        return self.scheduler.finish_remote_load(request_id, ok)

    # ---- cache ---------------------------------------------------------------------------------

    def clear_kv_blocks(self, medium: str | None = None) -> int:
        """Forgets every cached block of one tier (``MEDIA``) or of all (None), queueing one
        ``KvCleared``; clearing the device cache also releases every hold. Returns how many blocks
        were dropped."""
        if medium is not None and medium not in MEDIA:
            raise InvalidRequestError(f"unknown KV tier {medium!r}; expected one of {', '.join(MEDIA)}", param="tier")
        if medium in (None, MEDIUM_GPU):
            self.release_all_holds()
        return self.scheduler.reset_prefix_cache(medium)

    def kv_dump(self) -> list[KvStored]:
        """Every tier's blocks now, as stored events (device first, each with its medium); in the
        device cache every parent comes before its children."""
        dump = self._gpu_dump()
        if self.tiers is not None:
            dump.extend(self.tiers.dump())
        return dump

    def _gpu_dump(self) -> list[KvStored]:
        return [
            KvStored(
                parent_hash=run[0].parent_hash,
                blocks=[StoredBlock(b.block_hash, b.tokens_hash) for b in run],  # type: ignore[arg-type]
                lora_name=run[0].lora_name,
            )
            for run in self.kv_manager.block_pool.iter_cached_blocks()
        ]

    # ---- load ----------------------------------------------------------------------------------

    def load(self) -> CoreLoad:
        sched = self.scheduler
        pending = 0
        for request in sched.waiting:
            pending += request.prefill_target - request.num_computed_tokens
        for request, _ in sched.reading_from_disk.values():
            pending += request.prefill_target - request.num_computed_tokens
        for request in sched.running:
            if request.num_computed_tokens < request.prefill_target:
                pending += request.prefill_target - request.num_computed_tokens
        pool = self.kv_manager.block_pool
        seen = sched.prompt_tokens_seen
        return CoreLoad(
            num_waiting=sched.num_waiting,
            num_running=len(sched.running),
            # Blocks only a pin holds are cache, not sequences: they stay out of the active count.
            active_blocks=pool.get_num_used_blocks() - self.kv_manager.num_idle_pinned_blocks,
            total_blocks=pool.num_blocks,
            kv_usage=pool.get_usage(),
            active_prefill_tokens=pending,
            prefix_hit_rate=(sched.cached_tokens_seen / seen) if seen else 0.0,
            held_blocks=self.num_held_blocks,
            num_loading=sched.num_loading,
            tiers=self._tier_load(),
        )

    def _tier_load(self) -> dict[str, TierLoad] | None:
        tiers = self.tiers
        if tiers is None:
            return None
        seen = self.scheduler.onboarded_tokens_seen
        stats = tiers.stats
        return {
            tier.medium: TierLoad(
                blocks=len(tier), capacity=tier.capacity, hit_tokens=seen.get(tier.medium, 0),
                onboarded_blocks=stats.onboarded[tier.medium], offloaded_blocks=stats.offloaded[tier.medium],
            )
            for tier in tiers.tiers
        }
