"""``TrtllmEngine``: the Engine Protocol over TensorRT-LLM's LLM API (``tensorrt_llm.LLM``).

Written against TensorRT-LLM's current Python LLM API; TensorRT-LLM installs only with CUDA (its
PyPI package is a stub that fetches from NVIDIA's index), so this adapter has been exercised only
with recorded event payloads here (tests/unit/engines/test_trtllm_adapter.py).

- Flags: ``--trtllm-args`` is a JSON object of ``LLM(...)`` keyword arguments (``@file.json`` or
  ``@file.yaml`` reads a file, like trtllm-serve's ``--extra_llm_api_options``); TensorRT-LLM
  validates them. The adapter sets ``model``, turns block reuse on, sizes the KV event buffer
  (``event_buffer_max_size`` 4096) and defaults ``kv_cache_config.tokens_per_block`` to 64.
- Requests: ``generate_async(token_ids, SamplingParams(..., detokenize=False), streaming=True)``;
  new tokens are ``token_ids_diff``; closing the stream calls ``RequestOutput.abort()``. A prompt
  with images is a ``TokensPrompt`` dict with ``multi_modal_data`` and ``multi_modal_uuids``
  (multimodal.py); their ``mm_keys`` in the KV events key the router's blocks (kv_format.py).
- KV events: ``get_kv_cache_events_async`` (buffered per iteration) through ``TrtllmEventMapper``
  (kv_format.py) into the router converter; a jump in ``event_id`` is a gap.
- Load: ``get_stats_async`` (``kvCacheStats``, active and queued requests).
- Disaggregation (``--role prefill|decode``): context-only and generation-only requests with
  ``DisaggregatedParams``, carried between the legs as a JSON-safe dict (disagg.py).
- Not offered by the LLM API, so refused with a clear error: clearing the KV cache, sleep/wake.
  LoRA adapters are per request in TensorRT-LLM (``LoRARequest``, loaded on first use, evicted
  LRU): load_lora checks and registers the adapter, unload_lora stops routing to it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dynamod.daemon.engines.base import EngineInfo, EngineState, LoraInfo
from dynamod.daemon.engines.common.disagg import (
    ROLE_AGG,
    STAGE_DECODE,
    STAGE_PREFILL,
    prefill_request,
    request_stage,
)
from dynamod.daemon.engines.common.engine_base import NativeEngineBase, engine_request_error, request_errors
from dynamod.daemon.engines.common.images import decode_images, image_items
from dynamod.daemon.engines.common.lora import local_adapter_dir
from dynamod.daemon.engines.common.native_kv import DEFAULT_EVENT_BUFFER
from dynamod.daemon.engines.common.sampling import choice_grammar, refuse_unsupported, stop_kwargs
from dynamod.daemon.engines.trtllm import disagg
from dynamod.daemon.engines.trtllm.kv_format import TrtllmEventMapper
from dynamod.daemon.engines.trtllm.multimodal import trtllm_prompt
from dynamod.daemon.models.local import LocalModel
from dynamod.shared.errors import ConfigError, EngineError, InvalidRequestError, UnavailableError
from dynamod.shared.protocol.llm import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    PreprocessedRequest,
    Usage,
)
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.model_card import RuntimeConfig

logger = logging.getLogger(__name__)

DEFAULT_TOKENS_PER_BLOCK = 64
DEFAULT_EVENT_BUFFER_MAX_SIZE = 4096
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.1
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "cancelled": FINISH_ABORT, "abort": FINISH_ABORT}


def llm_kwargs(text: str | None, *, model_path: str, context_length: int | None,
               role: str = ROLE_AGG) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments from ``--trtllm-args`` plus the adapter's settings."""
    text = (text or "").strip()
    options: dict[str, Any] = {}
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        raw = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml  # present wherever TensorRT-LLM is (it depends on it)

            options = yaml.safe_load(raw) or {}
        else:
            options = json.loads(raw)
    elif text:
        try:
            options = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--trtllm-args must be a JSON object of LLM() arguments: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError("--trtllm-args must be a JSON object of LLM() arguments")
    if "model" in options:
        raise ConfigError("do not pass model inside --trtllm-args; the daemon's --model names the model")
    kv = dict(options.get("kv_cache_config") or {})
    kv["enable_block_reuse"] = True
    kv.setdefault("event_buffer_max_size", DEFAULT_EVENT_BUFFER_MAX_SIZE)
    kv.setdefault("tokens_per_block", DEFAULT_TOKENS_PER_BLOCK)
    options["kv_cache_config"] = kv
    if context_length and "max_seq_len" not in options:
        options["max_seq_len"] = context_length
    options["model"] = model_path
    return disagg.disaggregation_options(options, role)


def build_llm(options: dict[str, Any]) -> Any:
    """Builds ``tensorrt_llm.LLM`` (blocking: run in a thread)."""
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import CacheTransceiverConfig, KvCacheConfig

    opts = dict(options)
    opts["kv_cache_config"] = KvCacheConfig(**opts["kv_cache_config"])
    if isinstance(opts.get("cache_transceiver_config"), dict):
        opts["cache_transceiver_config"] = CacheTransceiverConfig(**opts["cache_transceiver_config"])
    return LLM(**opts)


def sampling_params(request: PreprocessedRequest, *, context_length: int) -> dict[str, Any]:
    """``tensorrt_llm.SamplingParams`` keyword arguments; an output constraint is returned as
    ``guided_decoding`` keyword arguments for ``GuidedDecodingParams`` (the caller builds it).
    TensorRT-LLM's LLM API has no logit bias or allowed-token list: those are refused."""
    s = request.sampling
    refuse_unsupported(request, ("logit_bias", "allowed_token_ids"), "TensorRT-LLM")
    out: dict[str, Any] = {"detokenize": False}
    for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    ):
        value = getattr(s, name)
        if value is not None:
            out[name] = value
    out.update(stop_kwargs(request, context_length=context_length))
    if s.logprobs is not None:
        out["logprobs"] = max(1, s.logprobs)
    guided = s.guided_decoding
    if guided is not None:
        kind = guided.kind
        if kind == "json":
            out["guided_decoding"] = {"json": guided.json}
        elif kind == "regex":
            out["guided_decoding"] = {"regex": guided.regex}
        elif kind == "choice":
            out["guided_decoding"] = {"grammar": choice_grammar(guided.choice or [])}
        else:
            out["guided_decoding"] = {"grammar": guided.grammar}
    return out


def cached_tokens(output: Any, block_size: int) -> int:
    """Prompt tokens served from the KV cache, from whichever field this release reports."""
    direct = getattr(output, "cached_tokens", None)
    if isinstance(direct, int):
        return direct
    completion = output.outputs[0] if getattr(output, "outputs", None) else None
    metrics = getattr(completion, "request_perf_metrics", None)
    kv = getattr(metrics, "kv_cache_metrics", None)
    reused = getattr(kv, "num_reused_blocks", None)
    return int(reused) * block_size if isinstance(reused, int) else 0


class TrtllmEngine(NativeEngineBase):
    """One ``tensorrt_llm.LLM`` as one worker (``_active``: request id -> its ``RequestOutput``)."""

    ENGINE_NAME = "TensorRT-LLM"

    def __init__(self, options: dict[str, Any], model: LocalModel, worker_id: int, *,
                 kv_event_buffer: int = DEFAULT_EVENT_BUFFER, role: str = ROLE_AGG) -> None:
        block = int(options["kv_cache_config"]["tokens_per_block"])
        info = EngineInfo(
            kv_block_size=block,
            context_length=int(options.get("max_seq_len") or model.context_length),
            runtime_config=RuntimeConfig(max_num_seqs=int(options.get("max_batch_size") or 0),
                                         max_num_batched_tokens=int(options.get("max_num_tokens") or 0)),
            vocab_size=model.vocab_size,
            eos_token_ids=list(model.eos_token_ids),
        )
        super().__init__(model, worker_id, info, role=role, kv_event_buffer=kv_event_buffer)
        self._options = options
        self._block = block
        self._mapper = TrtllmEventMapper(block)
        self._llm: Any = None
        self._stats: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def _start(self) -> None:
        """Builds the LLM and starts polling its event and stats queues."""
        started = time.monotonic()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            self._llm = await asyncio.to_thread(build_llm, self._options)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise EngineError(f"TensorRT-LLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        self.start_seconds = time.monotonic() - started
        self._tasks = [
            asyncio.create_task(self._poll(self._llm.get_kv_cache_events_async, self._on_event), name="trtllm-kv"),
            asyncio.create_task(self._poll(self._llm.get_stats_async, self._on_stats), name="trtllm-stats"),
        ]
        logger.info("trtllm engine started worker_id=%016x tokens_per_block=%d start_s=%.1f",
                    self.worker_id, self._block, self.start_seconds)

    async def _release(self) -> None:
        """A failed start: nothing was built (the LLM is the last thing ``_start`` makes)."""
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    async def _poll(self, source: Any, handle: Any) -> None:
        """Drains one of the LLM's per-iteration queues, backing off while it is empty."""
        delay = _POLL_MIN_S
        while True:
            got = False
            try:
                async for item in source(timeout=0):
                    got = True
                    handle(item)
            except (asyncio.QueueEmpty, TimeoutError, IndexError):
                pass
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("trtllm poll failed worker_id=%016x", self.worker_id)
            delay = _POLL_MIN_S if got else min(_POLL_MAX_S, delay * 1.5)
            await asyncio.sleep(delay)

    def _on_event(self, event: dict[str, Any]) -> None:
        missing = self._mapper.gap_before(event)
        rank = int(event.get("attention_dp_rank") or 0)
        if missing:
            self._feed.on_gap(rank, missing)
        batch = self._mapper.map(event)
        if batch is not None:
            self._feed.on_batch(rank, batch)

    def _on_stats(self, stat: Any) -> None:
        if isinstance(stat, str):
            stat = json.loads(stat)
        self._stats = stat
        kv = stat.get("kvCacheStats") or {}
        if kv.get("maxNumBlocks"):
            self._info.runtime_config.total_kv_blocks = int(kv["maxNumBlocks"])

    async def stop(self) -> None:
        if self._status == EngineState.STOPPED:
            return
        self._status = EngineState.STOPPED
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for result in list(self._active.values()):
            result.abort()
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        self._feed.close()
        logger.info("trtllm engine stopped worker_id=%016x", self.worker_id)

    def _started(self) -> Any:
        if self._llm is None or self._status != EngineState.READY:
            raise UnavailableError(f"TensorRT-LLM engine of worker {self.worker_id:x} is {self._status}")
        return self._llm

    # ---- requests ------------------------------------------------------------------------------

    async def _generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        llm = self._started()
        from tensorrt_llm import SamplingParams
        from tensorrt_llm.executor import LoRARequest
        from tensorrt_llm.llmapi import DisaggregatedParams

        rid = request.request_id
        self._check_new_request(rid)
        stage = request_stage(self.role, request, engine="TensorRT-LLM")
        disagg_params = None
        if stage == STAGE_PREFILL:
            request = prefill_request(request)
            disagg_params = DisaggregatedParams(request_type=disagg.CONTEXT_ONLY)
        elif stage == STAGE_DECODE:
            assert request.disaggregated_params is not None
            disagg_params = disagg.decode_params(request.disaggregated_params, DisaggregatedParams)
        lora_request = None
        if request.lora_name:
            lora = self._request_lora(request.lora_name)
            lora_request = LoRARequest(lora.name, lora.lora_id, lora.source)
        try:
            kwargs = sampling_params(request, context_length=self._info.context_length)
            if "guided_decoding" in kwargs:
                from tensorrt_llm.sampling_params import GuidedDecodingParams

                kwargs["guided_decoding"] = GuidedDecodingParams(**kwargs["guided_decoding"])
            params = SamplingParams(**kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"bad sampling parameters: {exc}") from None
        items = image_items(request)
        prompt = trtllm_prompt(request.token_ids, items, await decode_images(items))  # multimodal.py
        result = llm.generate_async(prompt, sampling_params=params, streaming=True,
                                    lora_request=lora_request, disaggregated_params=disagg_params)
        self._active[rid] = result
        prompt, done, cached = len(request.token_ids), 0, 0
        context_result = None  # a prefill leg's DisaggregatedParams, from whichever output has them
        finished = False
        try:
            with request_errors(functools.partial(engine_request_error, self.ENGINE_NAME)):
                async for out in result:
                    completion = out.outputs[0]
                    new = list(completion.token_ids_diff)
                    done += len(new)
                    cached = cached_tokens(out, self._block) or cached
                    context_result = getattr(completion, "disaggregated_params", None) or context_result
                    reason = completion.finish_reason
                    final = _FINISH.get(str(reason), FINISH_STOP) if reason is not None or out.finished else None
                    if not new and final is None:
                        continue
                    msg = EngineOutput(token_ids=new, finish_reason=final)
                    if final is not None:
                        msg.usage = Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=done)
                        finished = True
                        if stage == STAGE_PREFILL and final in (FINISH_STOP, FINISH_LENGTH):
                            if context_result is None:
                                raise EngineError(
                                    f"TensorRT-LLM finished context-only request {rid!r} without disaggregated "
                                    "params; is cache_transceiver_config set on this worker?"
                                )
                            msg.disaggregated_params = disagg.encode_params(context_result)
                    yield msg
                    if finished:
                        return
            if not finished:
                finished = True
                yield EngineOutput(finish_reason=FINISH_ABORT,
                                   usage=Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=done))
        finally:
            self._active.pop(rid, None)
            if not finished:
                result.abort()

    async def abort(self, request_id: str) -> None:
        result = self._active.get(request_id)
        if result is not None:
            result.abort()

    # ---- cache, load, controls ------------------------------------------------------------------

    async def clear_kv_blocks(self, medium: str | None = None) -> int:
        raise InvalidRequestError("TensorRT-LLM's LLM API has no way to drop the cached KV blocks of a running engine")

    def load_metrics(self) -> list[LoadMetrics]:
        kv = self._stats.get("kvCacheStats") or {}
        total = int(kv.get("maxNumBlocks") or 0)
        idle = not self._active
        used = 0 if idle else int(kv.get("usedNumBlocks") or 0)
        reused, missed = int(kv.get("reusedBlocks") or 0), int(kv.get("missedBlocks") or 0)
        return [LoadMetrics(
            worker_id=self.worker_id, dp_rank=0, active_decode_blocks=used, kv_usage=used / total if total else 0.0,
            total_blocks=total,
            num_waiting=0 if idle else int(self._stats.get("numQueuedRequests") or 0),
            num_running=0 if idle else int(self._stats.get("numActiveRequests") or len(self._active)),
            prefix_hit_rate=reused / (reused + missed) if reused + missed else 0.0,
            status=self._status, ts=time.time(),
        )]

    async def sleep(self, level: int) -> None:
        raise InvalidRequestError("TensorRT-LLM's LLM API has no sleep mode; drain the worker or stop it instead",
                                  param="level")

    async def wake_up(self) -> None:
        return None

    async def load_lora(self, name: str, source: str) -> LoraInfo:
        self._started()
        if not self._options.get("enable_lora") and not self._options.get("lora_config"):
            raise InvalidRequestError("LoRA is off: pass \"enable_lora\": true (and lora_config) in --trtllm-args",
                                      param="lora_name")
        path = local_adapter_dir(source)
        existing = self._loaded_lora(name, path)
        if existing is not None:
            return existing
        info = self._new_lora(name, path)
        self._loras[name] = info
        return info

    async def unload_lora(self, name: str) -> None:
        if self._loras.pop(name, None) is None:
            raise self._unknown_lora(name)
