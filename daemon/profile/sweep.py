"""The sweep plan and the in-process mocker sweep on a simulated clock.

What is measured, as Dynamo's profiler does (``profiler/profile_sla.py``):

- prefill: one request of each input length on an idle engine, ``max_tokens=1``: TTFT, and
  prefill throughput per GPU ``isl / ttft / gpus``;
- decode: for each context length, ``n`` concurrent requests whose prompts are already in the KV
  cache (so only decode runs), for growing ``n``: ITL is the mean duration of the steps that decode
  all ``n``, throughput per GPU ``n / itl / gpus``, KV usage ``n * context / max_kv_tokens``.

In-process, each point runs on a fresh ``MockerCore`` (no prefix-cache carry-over between
points) stepping the mocker's timing model without sleeping: the whole sweep takes seconds and is
deterministic, so the profile shipped with the package can be checked against a fresh run.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.daemon.perf.profile import DecodeRow, DecodeTable, PerfProfile, PrefillTable

DEFAULT_ISLS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
DEFAULT_DECODE_OSL = 32  # decode steps per point: enough for a stable mean, the batch stays whole
KV_HEADROOM = 0.95  # a point may fill at most this share of the KV cache (vLLM keeps a watermark)


@dataclass(frozen=True, slots=True)
class SweepPlan:
    isls: tuple[int, ...] = DEFAULT_ISLS
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCIES
    decode_osl: int = DEFAULT_DECODE_OSL
    engine_num_gpu: int = 1

    def prefill_points(self, context_length: int) -> list[int]:
        """Input lengths that leave room for the one output token a prefill point asks for."""
        return [i for i in self.isls if i < context_length]

    def decode_points(self, context: int, max_kv_tokens: int, max_num_seqs: int, context_length: int) -> list[int]:
        """Concurrencies that fit the engine at ``context`` tokens each (plus the decoded tail)."""
        if context + self.decode_osl > context_length:
            return []
        per = context + self.decode_osl
        return [n for n in self.concurrencies if n <= max_num_seqs and n * per <= KV_HEADROOM * max_kv_tokens]


def fresh_prompt(seed: int, length: int, vocab: int) -> list[int]:
    """Tokens no other point shares (no prefix-cache hits across points or requests)."""
    base = (seed * 7919) % (vocab - 1)
    return [(base + k) % (vocab - 1) + 1 for k in range(length)]


def measure_prefill(config: MockerConfig, isl: int) -> float:
    """TTFT (ms) of one ``isl``-token prompt on an idle mocker."""
    core = MockerCore(config)
    core.add_request("p", fresh_prompt(isl, isl, config.vocab_size), max_tokens=1, ignore_eos=True)
    elapsed = 0.0
    while core.has_unfinished_requests():
        out = core.step()
        elapsed += out.duration_ms
        if out.req_ids:
            return elapsed
    return elapsed


def measure_decode(config: MockerConfig, context: int, n: int, osl: int) -> float:
    """Mean ITL (ms) of ``n`` sequences of ``context`` tokens decoding together."""
    core = MockerCore(config)
    # Transferred prompts are admitted a step's token budget at a time; the first ones must not
    # finish before the last one joins, or no step ever decodes the whole batch.
    admission_steps = -(-n * context // config.max_num_batched_tokens) + 1
    for i in range(n):
        core.add_request(f"d{i}", fresh_prompt(context * 1000 + i, context, config.vocab_size),
                         max_tokens=osl + admission_steps, ignore_eos=True, kv_transferred=True)
    total, steps = 0.0, 0
    while core.has_unfinished_requests():
        out = core.step()
        if out.num_decode_reqs == n and not out.num_prefill_tokens:
            total += out.duration_ms
            steps += 1
        elif not (out.req_ids or out.num_prefill_reqs or out.finished) and not out.duration_ms:
            break  # nothing can run (the batch does not fit): give up on this point
    return total / steps if steps else 0.0


def sweep_mocker(config: MockerConfig, plan: SweepPlan | None = None) -> PerfProfile:
    """The profile of a live mocker with ``config``: its step times are divided by
    ``--speedup-ratio`` on the wall clock, so the profile's latencies are too (a planner compares
    them with what the frontends measure)."""
    plan = plan or SweepPlan()
    gpus = plan.engine_num_gpu
    max_kv = config.kv_capacity_tokens
    wall = 1.0 / config.speedup_ratio
    isls, ttfts, p_thpt = [], [], []
    for isl in plan.prefill_points(config.context_length):
        ttft = measure_prefill(config, isl) * wall
        if ttft > 0:
            isls.append(float(isl))
            ttfts.append(round(ttft, 4))
            p_thpt.append(round(isl / (ttft / 1000.0) / gpus, 3))
    rows = []
    for context in plan.contexts:
        usage, itls, d_thpt = [], [], []
        for n in plan.decode_points(context, max_kv, config.max_num_seqs, config.context_length):
            itl = measure_decode(config, context, n, plan.decode_osl) * wall
            if itl <= 0:
                continue
            usage.append(round(n * (context + plan.decode_osl / 2) / max_kv, 6))
            itls.append(round(itl, 4))
            d_thpt.append(round(n / (itl / 1000.0) / gpus, 3))
        if usage:
            rows.append(DecodeRow(float(context + plan.decode_osl / 2), usage, itls, d_thpt))
    settings = {
        "num_gpu_blocks": config.num_gpu_blocks, "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "speedup_ratio": config.speedup_ratio, "enable_prefix_caching": config.enable_prefix_caching,
        "decode_osl": plan.decode_osl,
        "source": "in-process mocker, simulated clock scaled to the wall clock by speedup_ratio",
    }
    return PerfProfile(PrefillTable(isls, ttfts, p_thpt, gpus), DecodeTable(rows, max_kv, gpus),
                       engine="mocker", settings=settings).validate()
