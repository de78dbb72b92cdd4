"""``MockerCore``: one simulated engine (one data-parallel rank), synchronous and clock-free.

It holds the whole state (scheduler, KV cache, requests) and advances it one engine step per
``step()`` call, returning what the step produced and how long it would have taken on the GPU.
It never sleeps, reads a clock or touches asyncio, so the async ``MockerEngine`` can pace it in
real time while a trace replayer drives many cores on a simulated clock as fast as the CPU allows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.kv_manager import KVCacheManager
from dynamod.daemon.engines.mocker.request import MockRequest
from dynamod.daemon.engines.mocker.scheduler import Scheduler
from dynamod.daemon.engines.mocker.timing import decode_time_ms, prefill_time_ms
from dynamod.shared.errors import ContextLengthError, InvalidRequestError
from dynamod.shared.protocol.kv_events import KvEvent, KvStored, StoredBlock
from dynamod.shared.protocol.llm import PreprocessedRequest, Usage


@dataclass(slots=True)
class FinishedRequest:
    request_id: str
    finish_reason: str  # "stop" | "length"
    usage: Usage
    num_preemptions: int = 0


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
    num_prefill_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    num_preempted: int = 0
    kv_usage: float = 0.0
    kv_events: list[KvEvent] = field(default_factory=list)


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


class MockerCore:
    """One engine's state. Not thread-safe; one owner calls it."""

    def __init__(self, config: MockerConfig, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.kv_manager = KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            watermark_blocks=config.watermark_blocks,
            context_length=config.context_length,
        )
        self._eos = frozenset(config.eos_token_ids)
        self.num_steps = 0
        self.simulated_ms = 0.0  # sum of step durations so far (before speedup)

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
    ) -> None:
        """Queues a request. Raises ``InvalidRequestError`` (``ContextLengthError`` for length)."""
        prompt = list(prompt_token_ids)
        max_out = self.check_request(request_id, prompt, max_tokens, min_tokens)
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
        )
        self.scheduler.add_request(request)

    def add_preprocessed(self, request: PreprocessedRequest) -> None:
        """``add_request`` from the ``generate`` endpoint's wire type."""
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
            kv_transferred=request.disaggregated_params is not None and not request.prefill_only,
        )

    def check_request(self, request_id: str, prompt: list[int], max_tokens: int | None, min_tokens: int) -> int:
        """Validates a request as vLLM's frontend does; returns its output token limit."""
        cfg = self.config
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        n = len(prompt)
        if n == 0:
            raise InvalidRequestError("the prompt is empty; it needs at least one token", param="prompt")
        lo, hi = min(prompt), max(prompt)
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
        return self.scheduler.abort(request_id) is not None

    def abort_all(self) -> list[str]:
        """Aborts every request (sleep, stop); returns their ids."""
        ids = list(self.scheduler.requests)
        for request_id in ids:
            self.scheduler.abort(request_id)
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---- stepping ------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Runs one engine step: schedule, "compute" (timing model), sample, finish."""
        sched = self.scheduler.schedule()
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
            out.decode_ms = decode_time_ms(kv_usage)
        out.duration_ms = out.prefill_ms + out.decode_ms
        result = self.scheduler.update_from_output(sched)
        out.req_ids = result.req_ids
        out.token_ids = result.token_ids
        for request in result.finished:
            out.finished.append(
                FinishedRequest(
                    request.request_id,
                    request.finish_reason or "stop",
                    Usage(
                        prompt_tokens=request.num_prompt_tokens,
                        cached_tokens=max(request.num_cached_tokens, 0),
                        completion_tokens=request.num_output_tokens,
                    ),
                    request.num_preemptions,
                )
            )
        out.kv_events = self.kv_manager.take_events()
        self.num_steps += 1
        self.simulated_ms += out.duration_ms
        return out

    def take_events(self) -> list[KvEvent]:
        """KV events produced outside ``step()`` (``clear_kv_blocks``)."""
        return self.kv_manager.take_events()

    # ---- cache ---------------------------------------------------------------------------------

    def clear_kv_blocks(self) -> int:
        """Forgets every cached block (queues ``KvCleared``); returns how many were cached."""
        return self.scheduler.reset_prefix_cache()

    def kv_dump(self) -> list[KvStored]:
        """The prefix cache now, as stored events with every parent before its children."""
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
        for request in sched.running:
            if request.num_computed_tokens < request.prefill_target:
                pending += request.prefill_target - request.num_computed_tokens
        pool = self.kv_manager.block_pool
        seen = sched.prompt_tokens_seen
        return CoreLoad(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            active_blocks=pool.get_num_used_blocks(),
            total_blocks=pool.num_blocks,
            kv_usage=pool.get_usage(),
            active_prefill_tokens=pending,
            prefix_hit_rate=(sched.cached_tokens_seen / seen) if seen else 0.0,
        )
