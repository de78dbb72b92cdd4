"""The live sweep: the same measurements as ``sweep.py``, against a running worker over the request plane.

For real engines (vLLM, SGLang, TensorRT-LLM) and for a mocker daemon. Requests go straight to
one instance of ``ns.component.endpoint`` (its ``generate`` endpoint takes a
``PreprocessedRequest``), one point at a time, wall clock:

- prefill: one request per input length, ``max_tokens=1``, fresh tokens (no prefix-cache hit);
  TTFT is the time to the first streamed token;
- decode: ``n`` concurrent requests per context length; ITL is the mean gap between tokens after
  every stream's first token (the prefills are then done, so the gaps are decode steps).

KV usage needs the engine's KV capacity: from the instance's model card
(``total_kv_blocks * kv_block_size``) or ``--max-kv-tokens``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import msgspec

from dynamod.daemon.perf.profile import DecodeRow, DecodeTable, PerfProfile, PrefillTable
from dynamod.daemon.profile.sweep import SweepPlan, fresh_prompt
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.errors import ConfigError, DynamoError
from dynamod.shared.protocol.keys import mdc_prefix
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions
from dynamod.shared.protocol.model_card import decode_card
from dynamod.shared.runtime.client import EndpointClient
from dynamod.shared.runtime.distributed import DistributedRuntime


@dataclass(frozen=True, slots=True)
class EndpointTarget:
    namespace: str
    component: str
    endpoint: str

    @classmethod
    def parse(cls, text: str) -> EndpointTarget:
        parts = text.split(".")
        if len(parts) != 3 or not all(parts):
            raise ConfigError(f"--endpoint must be namespace.component.endpoint, got {text!r}")
        return cls(*parts)


class _Live:
    def __init__(self, client: EndpointClient, instance_id: int, model: str, vocab: int, timeout_s: float) -> None:
        self.client = client
        self.instance_id = instance_id
        self.model = model
        self.vocab = vocab
        self.timeout_s = timeout_s
        self._ids = itertools.count()

    async def stream_times(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Wall times (s, monotonic) of each streamed token, the first entry being the send time."""
        rid = f"profile-{next(self._ids)}"
        body = msgspec.to_builtins(PreprocessedRequest(
            request_id=rid, model=self.model, token_ids=prompt, sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=max_tokens, ignore_eos=True)))
        times = [time.monotonic()]
        stream = self.client.generate(body, mode="direct", instance_id=self.instance_id,
                                      timeout_s=self.timeout_s, request_id=rid)
        async for item in stream:
            out = msgspec.convert(item, EngineOutput) if isinstance(item, dict) else item
            if getattr(out, "error", None):
                raise ConfigError(f"the worker failed a profiling request: {out.error}")
            now = time.monotonic()
            times.extend([now] * len(getattr(out, "token_ids", []) or []))
        return times


async def _max_kv_tokens(runtime: DistributedRuntime, target: EndpointTarget, instance_id: int) -> tuple[int, int, int]:
    """(KV capacity tokens, max_num_seqs, context length) from the instance's model card."""
    cards = await runtime.store.get_prefix(mdc_prefix(target.namespace))
    for key, value in cards.items():
        if key.rstrip("/").split("/")[-1] == f"{instance_id:x}" and f"/{target.component}/" in key:
            card = decode_card(value)
            return (card.runtime_config.total_kv_blocks * card.kv_block_size, card.runtime_config.max_num_seqs,
                    card.context_length)
    return 0, 0, 0


async def sweep_endpoint(settings: RuntimeSettings, target: EndpointTarget, plan: SweepPlan, *, model: str,
                         max_kv_tokens: int | None, vocab: int, timeout_s: float, wait_s: float) -> PerfProfile:
    runtime = await DistributedRuntime.create(settings)
    try:
        client = await runtime.namespace(target.namespace).component(target.component).endpoint(target.endpoint).client()
        try:
            instances = await client.wait_for_instances(1, timeout=wait_s)
        except (TimeoutError, DynamoError) as exc:
            raise ConfigError(f"no ready instance of {target.namespace}.{target.component}.{target.endpoint} "
                              f"within {wait_s:g}s") from exc
        inst = instances[0]
        card_kv, card_seqs, card_ctx = await _max_kv_tokens(runtime, target, inst.instance_id)
        max_kv = max_kv_tokens or card_kv
        if max_kv <= 0:
            raise ConfigError("the worker's model card gives no KV capacity; pass --max-kv-tokens")
        max_seqs = card_seqs or max(plan.concurrencies)
        context_length = card_ctx or max_kv
        live = _Live(client, inst.instance_id, model, vocab, timeout_s)
        isls, ttfts, p_thpt = [], [], []
        for isl in plan.prefill_points(context_length):
            times = await live.stream_times(fresh_prompt(isl + int(time.time()), isl, vocab), 1)
            if len(times) > 1:
                ttft_ms = (times[1] - times[0]) * 1000.0
                isls.append(float(isl))
                ttfts.append(round(ttft_ms, 3))
                p_thpt.append(round(isl / (ttft_ms / 1000.0) / plan.engine_num_gpu, 3))
        rows = []
        for context in plan.contexts:
            usage, itls, d_thpt = [], [], []
            for n in plan.decode_points(context, max_kv, max_seqs, context_length):
                seed = int(time.time() * 1000)
                runs = await asyncio.gather(*(live.stream_times(fresh_prompt(seed + i, context, vocab), plan.decode_osl)
                                              for i in range(n)))
                start = max(t[1] for t in runs if len(t) > 1)  # every prefill done
                gaps = [b - a for t in runs for a, b in itertools.pairwise(t[1:]) if a >= start]
                if not gaps:
                    continue
                itl_ms = sum(gaps) / len(gaps) * 1000.0
                usage.append(round(n * (context + plan.decode_osl / 2) / max_kv, 6))
                itls.append(round(itl_ms, 3))
                d_thpt.append(round(n / (itl_ms / 1000.0) / plan.engine_num_gpu, 3))
            if usage:
                rows.append(DecodeRow(float(context + plan.decode_osl / 2), usage, itls, d_thpt))
        settings_out = {"source": f"live endpoint {target.namespace}.{target.component}.{target.endpoint}",
                        "decode_osl": plan.decode_osl, "max_num_seqs": max_seqs, "context_length": context_length}
        return PerfProfile(PrefillTable(isls, ttfts, p_thpt, plan.engine_num_gpu),
                           DecodeTable(rows, max_kv, plan.engine_num_gpu), engine=model or "endpoint",
                           settings=settings_out).validate()
    finally:
        await runtime.shutdown(grace_s=1.0)
