"""``SglangEngine``: the Engine Protocol over SGLang's offline ``sglang.Engine``.

Written against SGLang's current Python API (``sglang.srt.entrypoints.engine.Engine`` and its
``tokenizer_manager``); SGLang needs CUDA, so this adapter has only been exercised with recorded
payloads here (tests/unit/engines/test_sglang_adapter.py), never against a running SGLang.

- Flags: ``--sglang-args`` is SGLang's own ``ServerArgs`` command line, parsed by SGLang. The
  adapter sets ``--model-path``, ``--skip-tokenizer-init`` (token ids in and out),
  ``--stream-output`` (deltas), ``--enable-cache-report`` (cached tokens in usage), the
  ``--kv-events-config`` it planned, and ``--page-size 64`` when absent (SGLang's default of 1 would
  make every token a routing block).
- KV events: SGLang's ZMQ publisher, same frames as vLLM, array-shaped events (kv_format.py),
  through the same subscriber, replay and gap handling as the vLLM adapter.
- Load: SGLang's schedulers push ``KvMetrics`` (pickled) to ``port_args.metrics_ipc_name``; the
  adapter binds that PULL socket when the engine has one, as Dynamo does, and reads it with a
  restricted unpickler that can build nothing but that report (metrics_wire.py), never
  ``recv_pyobj``: whoever can write to the socket must not run code in the worker.
- Images: ``image_data`` beside ``input_ids``, decoded at the frontend's sizes, with the frontend's
  hashes as ``mm_hashes`` where SGLang takes them; its image blocks' pad values are then keyed back
  to those hashes in its KV events (multimodal.py).
- Disaggregation (``--role prefill|decode``): SGLang's disaggregation mode and bootstrap rooms
  (disagg.py); a prefill leg yields its room first, then prefills; a decode leg joins the room.
- Controls: abort -> ``tokenizer_manager.abort_request``; clear -> ``flush_cache``; sleep/wake ->
  ``release_memory_occupation``/``resume_memory_occupation`` (needs ``--enable-memory-saver``);
  LoRA -> ``load_lora_adapter``/``unload_lora_adapter`` (needs ``--enable-lora``).

SGLang registers a signal handler while it launches, which Python allows only on the main thread;
the engine is built on a worker thread (loading takes minutes and the daemon's loop must keep its
lease alive), so that one call is made a no-op off the main thread during the build.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from dynamod.daemon.engines.base import EngineInfo, EngineState, LoraInfo
from dynamod.daemon.engines.common import flags
from dynamod.daemon.engines.common.disagg import (
    ROLE_AGG,
    ROLE_DECODE,
    STAGE_DECODE,
    STAGE_LOCAL,
    STAGE_PREFILL,
    prefill_request,
    request_stage,
)
from dynamod.daemon.engines.common.engine_base import NativeEngineBase, engine_request_error, request_errors
from dynamod.daemon.engines.common.images import decode_images, image_items
from dynamod.daemon.engines.common.kv_endpoints import plan_kv_events
from dynamod.daemon.engines.common.kv_subscriber import NativeKvSubscriber
from dynamod.daemon.engines.common.lora import local_adapter_dir
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER
from dynamod.daemon.engines.sglang import disagg
from dynamod.daemon.engines.sglang.kv_format import decode_sglang_batch
from dynamod.daemon.engines.sglang.metrics_wire import (
    MAX_PAYLOAD_BYTES,
    MetricsMessageError,
    decode_kv_metrics,
)
from dynamod.daemon.engines.sglang.multimodal import (
    ImagePads,
    image_token_id,
    rekeying_decoder,
    sglang_image_kwargs,
    takes_mm_hashes,
)
from dynamod.daemon.engines.sglang.outputs import SglangOutputTracker, sampling_params
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.errors import ConfigError, EngineError, InvalidRequestError, UnavailableError
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.model_card import RuntimeConfig

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 64
_METRICS_POLL_S = 0.5


class _MainThreadOnlySignals:
    """``signal`` as SGLang's engine module sees it during a build off the main thread."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    @staticmethod
    def signal(signum: int, handler: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            return signal.signal(signum, handler)
        logger.debug("sglang signal handler skipped off the main thread signum=%d", signum)
        return signal.getsignal(signum)


def sglang_argv(tokens: list[str], *, model_path: str, kv_events_config: dict[str, object],
                context_length: int | None, role: str = ROLE_AGG) -> list[str]:
    """SGLang's command line after the adapter's rewrites (see the module docstring)."""
    if flags.has_flag(tokens, "--model-path", "--model"):
        raise ConfigError("do not pass --model-path inside --sglang-args; the daemon's --model names the model")
    if flags.has_flag(tokens, "--disable-radix-cache"):
        logger.warning("sglang radix cache is off effect=no_kv_events_kv_routing_blind")
    argv = ["--model-path", model_path, *flags.without_flag(tokens, "--kv-events-config")]
    if not flags.has_flag(tokens, "--page-size"):
        argv += ["--page-size", str(DEFAULT_PAGE_SIZE)]
    if context_length and not flags.has_flag(tokens, "--context-length"):
        argv += ["--context-length", str(context_length)]
    for flag in ("--skip-tokenizer-init", "--stream-output", "--enable-cache-report"):
        if flag not in argv:
            argv.append(flag)
    argv += disagg.disaggregation_argv(tokens, role)
    argv += ["--kv-events-config", json.dumps(kv_events_config, separators=(",", ":"))]
    return argv


def build_sglang_engine(argv: list[str]) -> Any:
    """Parses ``argv`` with SGLang's parser and starts ``sglang.Engine`` (blocking: a thread)."""
    import argparse

    import sglang.srt.entrypoints.engine as engine_module
    from sglang.srt.server_args import ServerArgs

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:
            raise ConfigError(f"SGLang engine arguments: {message}")

    parser = _Parser(prog="--sglang-args")
    ServerArgs.add_cli_args(parser)
    try:
        server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    except SystemExit as exc:
        raise ConfigError(f"SGLang engine arguments ended the parser (exit {exc.code})") from None
    asyncio.set_event_loop(asyncio.new_event_loop())  # SGLang keeps one for its sync API
    real = engine_module.signal
    engine_module.signal = _MainThreadOnlySignals()  # type: ignore[assignment]
    try:
        return engine_module.Engine(server_args=server_args)
    finally:
        engine_module.signal = real


class SglangEngine(NativeEngineBase):
    """One ``sglang.Engine`` as one worker."""

    ENGINE_NAME = "SGLang"
    _active: dict[str, SglangOutputTracker]

    def __init__(self, tokens: list[str], model: LocalModel, worker_id: int, *, context_length: int | None = None,
                 kv_event_buffer: int = DEFAULT_EVENT_BUFFER, role: str = ROLE_AGG,
                 advertise_host: str = "127.0.0.1") -> None:
        tokens = list(tokens)
        dp = flags.int_flag(tokens, "--dp-size", "--data-parallel-size", "--dp") or 1
        info = EngineInfo(
            kv_block_size=flags.int_flag(tokens, "--page-size") or DEFAULT_PAGE_SIZE,
            context_length=flags.int_flag(tokens, "--context-length") or context_length or model.context_length,
            runtime_config=RuntimeConfig(max_num_seqs=flags.int_flag(tokens, "--max-running-requests") or 0,
                                         data_parallel_size=dp),
            vocab_size=model.vocab_size,
            eos_token_ids=list(model.eos_token_ids),
        )
        super().__init__(model, worker_id, info, role=role, kv_event_buffer=kv_event_buffer, data_parallel_size=dp)
        self._advertise_host = advertise_host
        self.bootstrap: tuple[str, int] | None = None  # a prefill engine's bootstrap server, once started
        self._tokens = tokens
        self._context_override = context_length
        self._subscriber: NativeKvSubscriber | None = None
        self._engine: Any = None
        self.sleep_level = 0
        self._private_dir: str | None = None
        self._metrics: dict[int, Any] = {}
        self._metrics_task: asyncio.Task[None] | None = None
        # A vision-language model's images: pad value -> frontend hash, to key its KV events (multimodal.py).
        image_token = image_token_id(model.path)
        self._image_pads = ImagePads(image_token) if image_token is not None else None
        self._takes_mm_hashes = False  # set once the engine is built

    # ---- lifecycle (``start()`` is NativeEngineBase's) -------------------------------------------

    async def _start(self) -> None:
        started = time.monotonic()
        self._private_dir = tempfile.mkdtemp(prefix=f"dynamod-sglang-{self.worker_id:x}-")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            plan = plan_kv_events(flags.user_kv_events_config(self._tokens), data_parallel_size=self._dp,
                                  private_dir=self._private_dir)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # SGLang's KVEventsConfig has no enable flag; drop ours so its pydantic model accepts it.
        config = {k: v for k, v in plan.config.items() if k != "enable_kv_cache_events"}
        decode = rekeying_decoder(decode_sglang_batch, self._image_pads)
        self._subscriber = NativeKvSubscriber(plan.subscribe, decode=decode, on_batch=self._feed.on_batch,
                                              on_gap=self._feed.on_gap, topic=plan.topic, replay=plan.replay)
        self._subscriber.open()
        plan.resolve(self._subscriber.bound)
        config["endpoint"] = plan.config["endpoint"]
        argv = sglang_argv(self._tokens, model_path=str(self.model.path), kv_events_config=config,
                           context_length=self._context_override, role=self.role)
        logger.info("sglang engine starting worker_id=%016x argv=%s", self.worker_id, " ".join(argv))
        try:
            self._engine = await asyncio.to_thread(build_sglang_engine, argv)
            self._takes_mm_hashes = takes_mm_hashes(self._engine)
        except (ConfigError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise EngineError(f"SGLang engine failed to start: {type(exc).__name__}: {exc}") from exc
        args = self._engine.server_args
        self._info.kv_block_size = int(args.page_size)
        if getattr(args, "context_length", None):
            self._info.context_length = int(args.context_length)
        if self.role != ROLE_AGG:
            self.bootstrap = disagg.bootstrap_endpoint(self._engine.tokenizer_manager.server_args, self._advertise_host)
            logger.info("sglang disaggregation role=%s bootstrap=%s:%d", self.role, *self.bootstrap)
        self._metrics_task = asyncio.create_task(self._read_metrics(), name=f"sglang-metrics-{self.worker_id:x}")
        self.start_seconds = time.monotonic() - started
        logger.info("sglang engine started worker_id=%016x page_size=%d start_s=%.1f",
                    self.worker_id, self._info.kv_block_size, self.start_seconds)

    async def _read_metrics(self) -> None:
        """Scheduler ``KvMetrics`` pushed to ``port_args.metrics_ipc_name``, when SGLang has it."""
        name = getattr(getattr(self._engine, "port_args", None), "metrics_ipc_name", None)
        if not name:
            logger.info("sglang scheduler metrics unavailable worker_id=%016x effect=load_from_request_counts", self.worker_id)
            return
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)  # a bigger message drops the peer, unread
        sock.bind(name)
        refused = 0
        try:
            while True:
                payload = await sock.recv()
                try:
                    m = decode_kv_metrics(payload)
                except MetricsMessageError as exc:
                    refused += 1
                    if refused == 1 or refused % 1000 == 0:
                        logger.warning("sglang metrics message refused worker_id=%016x count=%d reason=%s",
                                       self.worker_id, refused, exc)
                    continue
                self._metrics[int(m.data_parallel_rank or 0)] = m
        finally:
            sock.close(0)
            ctx.term()

    async def stop(self) -> None:
        if self._status == EngineState.STOPPED:
            return
        self._status = EngineState.STOPPED
        if self._engine is not None:
            for rid in list(self._active):
                self._abort_rid(rid)
        await self._release()
        logger.info("sglang engine stopped worker_id=%016x", self.worker_id)

    async def _release(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            await asyncio.gather(self._metrics_task, return_exceptions=True)
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                await asyncio.to_thread(engine.shutdown)
            except Exception:
                logger.exception("sglang shutdown failed worker_id=%016x", self.worker_id)
        if self._subscriber is not None:
            await self._subscriber.close()
            self._subscriber = None
        self._feed.close()
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    def _started(self) -> Any:
        if self._engine is None or self._status not in (EngineState.READY, EngineState.SLEEPING):
            raise UnavailableError(f"SGLang engine of worker {self.worker_id:x} is {self._status}")
        return self._engine

    # ---- requests ------------------------------------------------------------------------------

    async def _generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        engine = self._started()
        if self._status == EngineState.SLEEPING:
            raise UnavailableError(f"worker {self.worker_id:x} is asleep; wake it up first")
        rid = request.request_id
        self._check_new_request(rid)
        stage = request_stage(self.role, request, engine="SGLang")
        transfer: dict[str, Any] = {}
        if stage == STAGE_PREFILL:
            assert self.bootstrap is not None
            request = prefill_request(request)
            transfer = disagg.prefill_bootstrap(*self.bootstrap, request.disaggregated_params)
        elif stage == STAGE_DECODE:
            assert request.disaggregated_params is not None
            transfer = disagg.decode_bootstrap(request.disaggregated_params)
        elif stage == STAGE_LOCAL and self.role == ROLE_DECODE:
            raise UnavailableError(
                f"request {rid!r} reached SGLang decode worker {self.worker_id:x} without bootstrap parameters; "
                "an engine in SGLang's decode mode cannot prefill locally: start prefill workers, or run agg workers"
            )
        lora_path = None
        if request.lora_name:
            lora_path = self._request_lora(request.lora_name).name  # SGLang keys loaded adapters by name
        items = image_items(request)
        with_hashes = self._image_pads is not None and self._takes_mm_hashes
        image_kwargs = sglang_image_kwargs(items, await decode_images(items), with_hashes=with_hashes)  # multimodal.py
        if with_hashes and items:
            assert self._image_pads is not None
            self._image_pads.remember(items)
        tracker = SglangOutputTracker(len(request.token_ids))
        self._active[rid] = tracker
        finished = False
        try:
            kwargs: dict[str, Any] = {}
            if request.dp_rank is not None:
                kwargs["data_parallel_rank"] = request.dp_rank
            if request.sampling.logprobs is not None:
                kwargs["return_logprob"] = True
                if request.sampling.logprobs > 0:
                    kwargs["top_logprobs_num"] = request.sampling.logprobs
            kwargs.update(transfer)
            kwargs.update(image_kwargs)
            if stage == STAGE_PREFILL:
                # The decode leg starts on this frame; the prefill below waits for it to join the room.
                yield EngineOutput(disaggregated_params=dict(transfer))
            with request_errors(functools.partial(engine_request_error, self.ENGINE_NAME)):
                stream = await engine.async_generate(
                    input_ids=list(request.token_ids),
                    sampling_params=sampling_params(request, context_length=self._info.context_length),
                    stream=True, rid=rid, lora_path=lora_path, **kwargs,
                )
                async for chunk in stream:
                    out = tracker.map(chunk)
                    if out is None:
                        continue
                    finished = out.finish_reason is not None
                    yield out
                    if finished:
                        return
            if not finished:
                finished = True
                yield tracker.aborted()
        finally:
            self._active.pop(rid, None)
            if not finished and self._engine is not None:
                self._abort_rid(rid)

    def _abort_rid(self, rid: str) -> None:
        try:
            self._engine.tokenizer_manager.abort_request(rid=rid, abort_all=False)
        except Exception:
            logger.exception("sglang abort failed worker_id=%016x request_id=%s", self.worker_id, rid)

    async def abort(self, request_id: str) -> None:
        if request_id in self._active and self._engine is not None:
            self._abort_rid(request_id)

    # ---- load, cache ---------------------------------------------------------------------------

    async def clear_kv_blocks(self, medium: str | None = None) -> int:
        if medium not in (None, "GPU"):
            raise InvalidRequestError(f"this SGLang worker keeps no {medium} KV tier; clear the device cache (GPU)")
        engine = self._started()
        before = self._feed.table.num_blocks()
        result = await engine.tokenizer_manager.flush_cache()
        if not getattr(result, "success", True):
            raise UnavailableError(f"SGLang did not flush its cache on worker {self.worker_id:x} (requests in flight?)")
        self._emit_cleared()
        return before

    def load_metrics(self) -> list[LoadMetrics]:
        now = time.time()
        idle = not self._active
        out = []
        for rank in range(self._dp):
            m = self._metrics.get(rank)
            total = int(getattr(m, "kv_total_blocks", 0) or 0)
            active = 0 if idle or m is None else int(getattr(m, "kv_active_blocks", 0) or 0)
            out.append(LoadMetrics(
                worker_id=self.worker_id, dp_rank=rank, active_decode_blocks=active,
                kv_usage=active / total if total else 0.0, total_blocks=total,
                num_waiting=0 if idle or m is None else int(getattr(m, "num_requests_waiting", 0) or 0),
                num_running=0 if idle else (int(getattr(m, "request_active_slots", 0) or 0) if m is not None else len(self._active)),
                prefix_hit_rate=float(getattr(m, "gpu_prefix_cache_hit_rate", 0.0) or 0.0) if m is not None else 0.0,
                status=self._status, ts=now,
            ))
        return out

    # ---- sleep / wake --------------------------------------------------------------------------

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}", param="level")
        engine = self._started()
        if not getattr(engine.server_args, "enable_memory_saver", False):
            raise InvalidRequestError("sleep needs SGLang's memory saver: start with --enable-memory-saver in --sglang-args",
                                      param="level")
        if self._status == EngineState.SLEEPING:
            return
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        tags = ["kv_cache"] if level == 1 else None  # level 2 releases the weights too
        for rid in list(self._active):
            self._abort_rid(rid)
        await engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), None)
        self._status, self.sleep_level = EngineState.SLEEPING, level
        self._emit_cleared()

    async def wake_up(self) -> None:
        engine = self._started()
        if self._status != EngineState.SLEEPING:
            return
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await engine.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=None), None)
        self._status, self.sleep_level = EngineState.READY, 0

    # ---- LoRA ----------------------------------------------------------------------------------

    async def load_lora(self, name: str, source: str) -> LoraInfo:
        engine = self._started()
        if not getattr(engine.server_args, "enable_lora", False):
            raise InvalidRequestError("LoRA is off: start with --enable-lora in --sglang-args", param="lora_name")
        path = local_adapter_dir(source)
        existing = self._loaded_lora(name, path)
        if existing is not None:
            return existing
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        result = await engine.tokenizer_manager.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))
        if not getattr(result, "success", False):
            raise InvalidRequestError(f"SGLang could not load LoRA {name!r}: {getattr(result, 'error_message', '')}")
        info = self._new_lora(name, path)
        self._loras[name] = info
        return info

    async def unload_lora(self, name: str) -> None:
        if name not in self._loras:
            raise self._unknown_lora(name)
        engine = self._started()
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        await engine.tokenizer_manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name))
        del self._loras[name]
