"""``VllmEngine``: the Engine Protocol (daemon/engines/base.py) over vLLM's ``AsyncLLM``.

vLLM runs its engine core (scheduler, KV cache, model) in a child process; ``AsyncLLM`` is the
in-process client the worker daemon drives from its event loop. Building it loads the model and
sizes the KV cache (20-45 s on a 2-core CPU), so ``start()`` does that in a thread while the loop
keeps the worker's discovery lease alive.

KV events come from vLLM's own ZMQ publisher: ``start()`` opens our subscriber first (kv_endpoints
says who binds), then gives vLLM the matching ``--kv-events-config``. Load comes from vLLM's
scheduler stats through a stat logger. Requests go in as token ids with our sampling and stop
settings and come back as token-id deltas; cancelling (closing the stream) aborts them in vLLM.
A prompt with images goes in as vLLM's multimodal prompt, the images keyed by the frontend's
content hashes so vLLM's prefix-cache events name them as the router does (multimodal.py).

Disaggregation (``--role prefill|decode``): vLLM's own KV connector moves the blocks; the adapter
configures it and carries its ``kv_transfer_params`` between the legs (disagg.py).

Host KV tier (``--num-host-blocks``): vLLM's offloading connector (offload.py); its host copies
arrive as ``CPU`` events and reach the router as their own tier.

Mapped controls: ``clear_kv_blocks`` -> ``reset_prefix_cache`` (with the host tier,
``reset_connector`` empties it too; vLLM cannot empty it alone); ``sleep``/``wake_up`` -> vLLM's
sleep mode (needs ``--enable-sleep-mode``, CUDA/ROCm/XPU only; elsewhere a clear error instead of
vLLM's silent no-op); LoRA load/unload/list -> ``add_lora``/``remove_lora`` (needs
``--enable-lora``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from dynamod.daemon.engines.base import EngineInfo, EngineState, LoraInfo
from dynamod.daemon.engines.common.disagg import (
    ROLE_AGG,
    ROLE_DECODE,
    STAGE_DECODE,
    STAGE_PREFILL,
    prefill_request,
    request_stage,
)
from dynamod.daemon.engines.common.engine_base import NativeEngineBase, request_errors
from dynamod.daemon.engines.common.flags import user_kv_events_config
from dynamod.daemon.engines.common.images import decode_images, image_items
from dynamod.daemon.engines.common.kv_endpoints import plan_kv_events
from dynamod.daemon.engines.common.kv_subscriber import NativeKvSubscriber
from dynamod.daemon.engines.common.lora import local_adapter_dir
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER, NativeKvEventQueue
from dynamod.daemon.engines.vllm import disagg, flags, offload
from dynamod.daemon.engines.vllm.multimodal import vllm_prompt
from dynamod.daemon.engines.vllm.outputs import OutputTracker, sampling_kwargs
from dynamod.daemon.engines.vllm.stats import LoadTracker, make_stat_logger_factory
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.errors import ConfigError, DynamoError, EngineError, InvalidRequestError, UnavailableError
from dynamod.shared.observability.tracing import trace_headers_for
from dynamod.shared.protocol.kv_events import MEDIA, MEDIUM_CPU, MEDIUM_GPU, decode_native_batch
from dynamod.shared.protocol.llm import (
    FINISH_ABORT,
    FINISH_ERROR,
    EngineOutput,
    PreprocessedRequest,
    engine_priority,
)
from dynamod.shared.protocol.load import KvTierLoad, LoadMetrics
from dynamod.shared.protocol.model_card import RuntimeConfig

logger = logging.getLogger(__name__)


_HEALTH_POLL_S = 2.0
_SHUTDOWN_TIMEOUT_S = 30.0

# Set for the engine's child processes unless the operator set them: never reach a model hub; use
# spawn (forking a process that runs an event loop and threads is unsafe); keep vLLM's IPC sockets
# in the worker's private directory instead of /tmp.
_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def _shutdown_done(timeout: float | None = None) -> None:
    return None


def build_async_llm(argv: list[str], tracker: LoadTracker) -> Any:
    """Parses ``argv`` with vLLM's own parser and builds ``AsyncLLM`` (blocking: run in a thread)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    class _Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:  # argparse would exit the whole daemon
            raise ConfigError(f"vLLM engine arguments: {message}")

    try:
        namespace = AsyncEngineArgs.add_cli_args(_Parser(prog="--vllm-args")).parse_args(argv)
    except SystemExit as exc:  # --help or --version inside --vllm-args
        raise ConfigError(f"vLLM engine arguments ended the parser (exit {exc.code}); remove --help/--version") from None
    engine_args = AsyncEngineArgs.from_cli_args(namespace)
    return AsyncLLM.from_engine_args(engine_args, stat_loggers=[make_stat_logger_factory(tracker)])


def request_error(exc: BaseException) -> DynamoError:
    """vLLM's exception for a failed request as ours (bad input is the client's fault)."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return UnavailableError("vLLM engine is dead; see the worker log for the cause")
    cause = exc.__cause__ or exc
    if isinstance(cause, (ValueError, TypeError, VLLMClientError)):
        return InvalidRequestError(str(cause) or type(cause).__name__)
    return EngineError(f"vLLM request failed: {type(cause).__name__}: {cause}")


class VllmEngine(NativeEngineBase):
    """One vLLM ``AsyncLLM`` (all its data-parallel ranks) as one worker."""

    ENGINE_NAME = "vLLM"
    _active: dict[str, OutputTracker]

    def __init__(
        self,
        tokens: list[str],
        model: LocalModel,
        worker_id: int,
        *,
        context_length: int | None = None,
        kv_event_buffer: int = DEFAULT_EVENT_BUFFER,
        role: str = ROLE_AGG,
        advertise_host: str = "127.0.0.1",
        host_tier_bytes: int | None = None,
    ) -> None:
        """``host_tier_bytes``: vLLM's host KV tier (``cpu_bytes_to_use``, offload.py); None: off."""
        tokens = list(tokens) if host_tier_bytes is None else offload.without_offloading_flags(tokens)
        est = flags.estimates(tokens)
        info = EngineInfo(
            kv_block_size=est.block_size,
            context_length=est.max_model_len or context_length or model.context_length,
            runtime_config=RuntimeConfig(
                total_kv_blocks=est.num_gpu_blocks or 0,
                max_num_seqs=est.max_num_seqs or 0,
                max_num_batched_tokens=est.max_num_batched_tokens or 0,
                data_parallel_size=est.data_parallel_size,
            ),
            vocab_size=model.vocab_size,
            eos_token_ids=list(model.eos_token_ids),
        )
        # With a host tier, vLLM's own AllBlocksCleared (from its device block pool) empties the
        # device only; the host copies stay until vLLM announces their removal.
        super().__init__(
            model, worker_id, info, role=role, kv_event_buffer=kv_event_buffer,
            data_parallel_size=est.data_parallel_size,
            cleared_medium=MEDIUM_GPU if host_tier_bytes is not None else None,
        )
        self._advertise_host = advertise_host
        self._host_tier_bytes = host_tier_bytes
        self._host_tier_capacity = 0  # blocks, known once the engine's block size is (_adopt_config)
        self._tokens = tokens
        self._kv_transfer = offload.kv_transfer_config(role, self._tokens, host_tier_bytes)
        self._context_override = context_length
        self._load = LoadTracker(self._dp)
        self._subscriber: NativeKvSubscriber | None = None
        self._llm: Any = None
        self._model_defaults: dict[str, Any] = {}
        # vLLM's --scheduling-policy is "priority": requests carry their priority to it (under
        # "fcfs" vLLM ignores priorities, and versions before 0.10 refuse a non-zero one).
        self._priority_scheduling = False
        self.sleep_level = 0
        self._private_dir: str | None = None
        self._health_task: asyncio.Task[None] | None = None

    # ---- lifecycle (``start()`` is NativeEngineBase's) -------------------------------------------

    @property
    def host_tier(self) -> bool:
        """Whether vLLM keeps a host (CPU) KV tier behind its device cache."""
        return self._host_tier_bytes is not None

    @property
    def kv_feed(self) -> NativeKvEventQueue:
        return self._feed

    @property
    def subscriber(self) -> NativeKvSubscriber | None:
        return self._subscriber

    async def _start(self) -> None:
        started = time.monotonic()
        self._private_dir = tempfile.mkdtemp(prefix=f"dynamod-vllm-{self.worker_id:x}-")
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_RPC_BASE_PATH", self._private_dir)
        if flags.prefix_caching_disabled(self._tokens):
            logger.warning("vllm prefix caching is off worker_id=%016x effect=no_kv_events_kv_routing_blind", self.worker_id)
        if self.host_tier:
            await asyncio.to_thread(offload.check_platform)
        try:
            plan = plan_kv_events(
                user_kv_events_config(self._tokens),
                data_parallel_size=self._dp,
                private_dir=self._private_dir,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._subscriber = NativeKvSubscriber(
            plan.subscribe,
            decode=decode_native_batch,
            on_batch=self._feed.on_batch,
            on_gap=self._feed.on_gap,
            topic=plan.topic,
            replay=plan.replay,
        )
        self._subscriber.open()  # before the engine: its publisher may connect to us at once
        plan.resolve(self._subscriber.bound)
        argv = flags.engine_argv(
            self._tokens,
            model_path=str(self.model.path),
            kv_events_config=plan.config,
            max_model_len=self._context_override,
            kv_transfer_config=self._kv_transfer,
        )
        if self.role != ROLE_AGG:
            # Read by the engine's own processes, which inherit the environment when spawned below.
            side_channel = disagg.side_channel_env(self._advertise_host, self._dp)
            os.environ.update(side_channel)
            logger.info("vllm kv transfer role=%s side_channel=%s:%s", self.role,
                        side_channel[disagg.SIDE_CHANNEL_HOST_ENV], side_channel[disagg.SIDE_CHANNEL_PORT_ENV])
        logger.info("vllm engine starting worker_id=%016x argv=%s", self.worker_id, " ".join(argv))
        try:
            self._llm = await asyncio.to_thread(build_async_llm, argv, self._load)
        except (ConfigError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise EngineError(f"vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        self._adopt_config()
        self.start_seconds = time.monotonic() - started
        self._health_task = asyncio.create_task(self._watch_health(), name=f"vllm-health-{self.worker_id:x}")
        rc = self._info.runtime_config
        logger.info(
            "vllm engine started worker_id=%016x block_size=%d total_kv_blocks=%d context_length=%d max_num_seqs=%d "
            "dp=%d lora=%s sleep_mode=%s host_tier_bytes=%s priority_scheduling=%s start_s=%.1f",
            self.worker_id, self._info.kv_block_size, rc.total_kv_blocks, self._info.context_length,
            rc.max_num_seqs, rc.data_parallel_size, self._lora_enabled(), self._sleep_enabled(),
            self._host_tier_bytes or 0, self._priority_scheduling, self.start_seconds,
        )

    def _adopt_config(self) -> None:
        """The engine's real geometry replaces the flag estimates (in place: the daemon holds it)."""
        cfg = self._llm.vllm_config
        dp = max(1, int(cfg.parallel_config.data_parallel_size))
        block_size = int(cfg.cache_config.block_size)
        if block_size != self._info.kv_block_size:
            logger.warning(
                "vllm block size differs from the flags worker_id=%016x flags=%d engine=%d "
                "effect=a card published before start is stale",
                self.worker_id, self._info.kv_block_size, block_size,
            )
        self._dp = dp
        self._priority_scheduling = str(getattr(cfg.scheduler_config, "policy", "fcfs")) == "priority"
        self._info.kv_block_size = block_size
        self._info.context_length = int(cfg.model_config.max_model_len)
        total = int(cfg.cache_config.num_gpu_blocks or 0)
        self._info.runtime_config = RuntimeConfig(
            total_kv_blocks=total // dp,
            max_num_seqs=int(cfg.scheduler_config.max_num_seqs),
            max_num_batched_tokens=int(cfg.scheduler_config.max_num_batched_tokens),
            data_parallel_size=dp,
        )
        self._load.total_blocks_per_rank = total // dp
        if self._host_tier_bytes is not None:
            self._host_tier_capacity = offload.host_tier_blocks(
                self._host_tier_bytes, block_size, self.model.kv_geometry, self._tokens
            )
        try:
            self._model_defaults = dict(self._llm.model_config.get_diff_sampling_param())
        except Exception:  # a model without generation_config.json is fine
            self._model_defaults = {}
        self._model_defaults.pop("max_new_tokens", None)
        self._model_defaults.pop("max_tokens", None)

    async def _watch_health(self) -> None:
        """Notices an engine core that died between requests (checked every 2 s, no RPC)."""
        while self._status in (EngineState.READY, EngineState.SLEEPING):
            try:
                await self.check_health()
            except UnavailableError:
                self._status = EngineState.FAILED
                logger.error("vllm engine died worker_id=%016x", self.worker_id)
                return
            await asyncio.sleep(_HEALTH_POLL_S)

    async def check_health(self) -> None:
        """Raises ``UnavailableError`` when the engine cannot serve."""
        if self._llm is None or self._status in (EngineState.STOPPED, EngineState.FAILED):
            raise UnavailableError(f"vLLM engine of worker {self.worker_id:x} is {self._status}")
        try:
            await self._llm.check_health()
        except Exception as exc:
            raise UnavailableError(f"vLLM engine of worker {self.worker_id:x} is dead: {exc}") from None

    async def stop(self) -> None:
        if self._status == EngineState.STOPPED:
            return
        was = self._status
        self._status = EngineState.STOPPED
        if self._health_task is not None:
            self._health_task.cancel()
        if self._llm is not None and self._active and was != EngineState.FAILED:
            try:
                await self._llm.abort(list(self._active))
            except Exception:
                logger.exception("vllm abort on stop failed worker_id=%016x", self.worker_id)
        await self._release()
        logger.info("vllm engine stopped worker_id=%016x", self.worker_id)

    async def _release(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            # Its output handler would report the engine core's exit as a failure: end it first.
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
                llm.output_handler = None
            try:
                # Joins the engine core process: seconds, so off the event loop.
                await asyncio.wait_for(asyncio.to_thread(llm.shutdown, _SHUTDOWN_TIMEOUT_S), _SHUTDOWN_TIMEOUT_S + 5)
            except Exception:
                logger.exception("vllm shutdown failed worker_id=%016x", self.worker_id)
            # Its __del__ shuts down again, which fails (noisily) when that happens while the
            # interpreter tears modules down: the shutdown is done, make the second one a no-op.
            llm.shutdown = _shutdown_done
        if self._subscriber is not None:
            await self._subscriber.close()
            self._subscriber = None
        self._feed.close()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def _check_serving(self) -> None:
        if self._status == EngineState.READY:
            return
        if self._status == EngineState.SLEEPING:
            raise UnavailableError(f"worker {self.worker_id:x} is asleep (level {self.sleep_level}); wake it up first")
        raise UnavailableError(f"vLLM engine of worker {self.worker_id:x} is {self._status}")

    def _check_started(self) -> Any:
        if self._llm is None or self._status not in (EngineState.READY, EngineState.SLEEPING):
            raise UnavailableError(f"vLLM engine of worker {self.worker_id:x} is {self._status}")
        return self._llm

    def _lora_enabled(self) -> bool:
        return self._llm is not None and self._llm.vllm_config.lora_config is not None

    def _sleep_enabled(self) -> bool:
        return self._llm is not None and bool(self._llm.model_config.enable_sleep_mode)

    # ---- requests ------------------------------------------------------------------------------

    async def _generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Streams token-id deltas; the last output has ``finish_reason`` and ``usage`` (with the
        prompt tokens vLLM found in its prefix cache). Closing the stream aborts the request."""
        self._check_serving()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        llm = self._llm
        rid = request.request_id
        self._check_new_request(rid)
        stage = request_stage(self.role, request, engine="vLLM")
        extra_args: dict[str, Any] | None = None
        if stage == STAGE_PREFILL:
            request = prefill_request(request)
            extra_args = {"kv_transfer_params": disagg.prefill_transfer_params()}
        elif stage == STAGE_DECODE:
            assert request.disaggregated_params is not None
            extra_args = {"kv_transfer_params": disagg.decode_transfer_params(request.disaggregated_params)}
        lora_request = None
        if request.lora_name:
            lora = self._request_lora(request.lora_name)
            lora_request = LoRARequest(lora.name, lora.lora_id, lora.source)
        if request.dp_rank is not None and not 0 <= request.dp_rank < self._dp:
            raise InvalidRequestError(f"dp_rank {request.dp_rank} out of range [0, {self._dp})", param="dp_rank")
        try:
            kwargs = sampling_kwargs(request, context_length=self._info.context_length, model_defaults=self._model_defaults)
            if "structured_outputs" in kwargs:
                from vllm.sampling_params import StructuredOutputsParams

                kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
            params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA, extra_args=extra_args)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"bad sampling parameters: {exc}") from None
        # Images: decoded here at the frontend's sizes, keyed by the frontend's hashes (multimodal.py).
        items = image_items(request)
        prompt = vllm_prompt(request.token_ids, items, await decode_images(items))
        # No per-request pinning in vLLM's API: a cache_control pin is reported refused (outputs.py).
        tracker = OutputTracker(len(request.token_ids), request.sampling.logprobs or 0, pin_refused=request.pin is not None)
        self._active[rid] = tracker
        stream = llm.generate(
            TokensPrompt(**prompt),
            params,
            rid,
            lora_request=lora_request,
            data_parallel_rank=request.dp_rank,
            # Dynamo's priority is "higher first", vLLM's "lower first".
            priority=engine_priority(request.priority) if self._priority_scheduling else 0,
            # The worker's request span: vLLM's own spans (with --otlp-traces-endpoint) join the trace.
            trace_headers=trace_headers_for(rid),
        )
        finished = False
        try:
            # vLLM's stream ends by itself after the finished output; running it to its end
            # (rather than closing it) spares the engine an abort per request.
            with request_errors(request_error):
                async for ro in stream:
                    out = tracker.map(ro)
                    if out is None:
                        continue
                    finished = out.finish_reason is not None
                    if finished and stage == STAGE_PREFILL:
                        self._check_prefill_result(out, rid)
                    yield out
            if not finished:  # the stream ended without a final output: it was aborted
                finished = True
                yield tracker.aborted()
        finally:
            self._active.pop(rid, None)
            if not finished:
                # Closing vLLM's unfinished stream aborts the request in the engine core.
                await stream.aclose()
                logger.debug("vllm request aborted worker_id=%016x request_id=%s", self.worker_id, rid)

    def _check_prefill_result(self, out: EngineOutput, rid: str) -> None:
        """A prefill leg that ended without transfer parameters leaves the decode leg nothing to
        read: say why instead of letting the frontend wait for parameters that never come."""
        if out.disaggregated_params:
            return
        if out.finish_reason in (FINISH_ABORT, FINISH_ERROR):
            return  # the frontend sees the abort/error itself
        connector = (disagg.user_kv_transfer_config(self._tokens) or {}).get("kv_connector", disagg.DEFAULT_CONNECTOR)
        raise EngineError(
            f"vLLM finished prefill request {rid!r} without kv_transfer_params: its KV connector ({connector}) "
            "did not hold the blocks for a remote decode"
        )

    async def abort(self, request_id: str) -> None:
        if request_id in self._active and self._llm is not None:
            await self._llm.abort(request_id)

    # ---- KV cache and load ---------------------------------------------------------------------

    async def clear_kv_blocks(self, medium: str | None = None) -> int:
        """``reset_prefix_cache``: the device cache (``GPU``), or every tier (None), which with a host
        tier also resets vLLM's offloading connector (``reset_connector``). vLLM has no call that
        empties the host tier alone, so ``CPU`` by itself is refused. vLLM publishes the device's
        cleared event only with its next step and none for the host tier, so the adapter emits them
        at once (a late native one is harmless: nothing was stored in between)."""
        if medium is not None and medium not in MEDIA:
            raise InvalidRequestError(f"unknown KV tier {medium!r}; expected one of {', '.join(MEDIA)}", param="tier")
        if medium not in (None, MEDIUM_GPU, MEDIUM_CPU) or (medium == MEDIUM_CPU and not self.host_tier):
            raise InvalidRequestError(f"this vLLM worker keeps no {medium} KV tier; clear the device cache (GPU)", param="tier")
        if medium == MEDIUM_CPU:
            raise InvalidRequestError(
                "vLLM empties its host (CPU) KV tier only together with its device cache; clear every tier instead",
                param="tier",
            )
        llm = self._check_started()
        with_host = self.host_tier and medium is None
        before = self._feed.table.num_blocks()
        if with_host:
            before += self._feed.table.num_blocks(medium=MEDIUM_CPU)
        if not await llm.reset_prefix_cache(reset_connector=with_host):
            if with_host:
                # vLLM resets the connector even when the device reset is refused: say so.
                self._emit_cleared(MEDIUM_CPU)
            raise UnavailableError(
                f"vLLM resets its prefix cache only when no request holds KV blocks "
                f"({len(self._active)} in flight on worker {self.worker_id:x}); drain the worker or retry when idle"
            )
        self._emit_cleared(MEDIUM_GPU if self.host_tier and medium == MEDIUM_GPU else None)
        logger.info(
            "vllm prefix cache reset worker_id=%016x medium=%s blocks=%d", self.worker_id, medium or "all", before
        )
        return before

    def load_metrics(self) -> list[LoadMetrics]:
        metrics = self._load.snapshot(self.worker_id, idle=not self._active, status=self._status, ts=time.time())
        if self.host_tier:
            for m in metrics:
                m.kv_tiers = {MEDIUM_CPU: self._host_tier_load(m.dp_rank)}
        return metrics

    def _host_tier_load(self, rank: int) -> KvTierLoad:
        """The host tier of one rank: blocks as its events tell, loads as vLLM's connector stats
        count them (on a decode worker those also count NIXL's remote reads, so none are claimed)."""
        blocks = self._feed.table.num_blocks(rank, medium=MEDIUM_CPU)
        capacity = self._host_tier_capacity
        hits = 0 if self.role == ROLE_DECODE else self._load.connector_hits(rank)
        block_size = self._info.kv_block_size
        return KvTierLoad(
            blocks=blocks,
            total_blocks=capacity,
            usage=min(blocks / capacity, 1.0) if capacity else 0.0,
            hit_tokens=hits,
            onboarded_blocks=hits // block_size if block_size else 0,
            offloaded_blocks=self._feed.lower_stored.get((rank, MEDIUM_CPU), 0),
        )

    # ---- sleep / wake --------------------------------------------------------------------------

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}", param="level")
        llm = self._check_started()
        if not self._sleep_enabled():
            from vllm.platforms import current_platform

            where = (
                "start the worker with --enable-sleep-mode in --vllm-args"
                if current_platform.is_sleep_mode_available()
                else f"vLLM has no sleep mode on this platform ({current_platform.device_type or 'unknown'}); "
                "it exists on CUDA, ROCm and XPU"
            )
            raise InvalidRequestError(f"sleep is not available on worker {self.worker_id:x}: {where}", param="level")
        if self._status == EngineState.SLEEPING:
            self.sleep_level = max(self.sleep_level, level)
            return
        aborted = len(self._active)
        await llm.sleep(level)  # mode "abort": in-flight requests end as aborted
        self._status = EngineState.SLEEPING
        self.sleep_level = level
        self._emit_cleared()
        logger.info("vllm asleep worker_id=%016x level=%d aborted=%d", self.worker_id, level, aborted)

    async def wake_up(self) -> None:
        llm = self._check_started()
        if self._status != EngineState.SLEEPING:
            return
        await llm.wake_up()
        level, self.sleep_level = self.sleep_level, 0
        self._status = EngineState.READY
        logger.info("vllm awake worker_id=%016x from_level=%d", self.worker_id, level)

    # ---- LoRA ----------------------------------------------------------------------------------

    async def load_lora(self, name: str, source: str) -> LoraInfo:
        if not name:
            raise InvalidRequestError("lora_name must not be empty", param="lora_name")
        llm = self._check_started()
        if not self._lora_enabled():
            raise InvalidRequestError(
                "LoRA is off on this worker: start it with --enable-lora (and --max-lora-rank at least the "
                "adapter's rank) in --vllm-args",
                param="lora_name",
            )
        path = local_adapter_dir(source)
        existing = self._loaded_lora(name, path)
        if existing is not None:
            return existing
        from vllm.lora.request import LoRARequest

        info = self._new_lora(name, path)
        try:
            added = await llm.add_lora(LoRARequest(name, info.lora_id, path))
        except Exception as exc:
            raise InvalidRequestError(f"vLLM could not load LoRA adapter {name!r} from {path}: {exc}") from None
        if not added:
            raise EngineError(f"vLLM refused LoRA adapter {name!r} from {path}")
        self._loras[name] = info
        logger.info("vllm lora loaded worker_id=%016x lora=%s lora_id=%d source=%s", self.worker_id, name, info.lora_id, path)
        return info

    async def unload_lora(self, name: str) -> None:
        info = self._loras.get(name)
        if info is None:
            raise self._unknown_lora(name)
        llm = self._check_started()
        await llm.remove_lora(info.lora_id)
        del self._loras[name]
        logger.info("vllm lora unloaded worker_id=%016x lora=%s lora_id=%d", self.worker_id, name, info.lora_id)
