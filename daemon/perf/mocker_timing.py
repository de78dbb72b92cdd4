"""Dynamo's mocker timing model: how long one engine step takes on the simulated GPU.

Both curves are Dynamo's polynomial fits (milliseconds, before ``--speedup-ratio``):

- prefill of ``T`` new (uncached) tokens in one step: ``4.209989e-07 T^2 + 1.518344e-02 T + 16.50142``
- a decode step: ``-25.74 p^2 + 54.01 p + 5.74`` (at least 1 ms), where ``p`` is the active KV
  tokens (blocks held by requests times the block size) over the KV capacity, clamped to [0, 1].

A step that prefills and decodes pays both, as Dynamo's scheduler does (prefill pass, then decode).
"""

from __future__ import annotations

# The simulated engine's shape, which the timing above assumes and the disaggregation policy's default
# predictions share: a step's token budget (vLLM's max_num_batched_tokens) and the KV bytes per token
# (Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2

PREFILL_A = 4.209989e-07
PREFILL_B = 1.518344e-02
PREFILL_C = 16.50142
DECODE_A = -25.74
DECODE_B = 54.01
DECODE_C = 5.74
MIN_DECODE_MS = 1.0


def prefill_time_ms(num_new_tokens: int) -> float:
    """Time to prefill ``num_new_tokens`` uncached tokens in one step; 0 for none."""
    if num_new_tokens <= 0:
        return 0.0
    t = float(num_new_tokens)
    return PREFILL_A * t * t + PREFILL_B * t + PREFILL_C


def decode_time_ms(active_kv_fraction: float) -> float:
    """Time of one decode step at KV occupancy ``active_kv_fraction`` (clamped to [0, 1])."""
    p = min(max(active_kv_fraction, 0.0), 1.0)
    return max(DECODE_A * p * p + DECODE_B * p + DECODE_C, MIN_DECODE_MS)


def step_time_ms(num_prefill_tokens: int, num_decode_reqs: int, active_kv_fraction: float) -> float:
    """One step's simulated duration: prefill cost if it prefilled, plus decode cost if it decoded."""
    total = prefill_time_ms(num_prefill_tokens)
    if num_decode_reqs > 0:
        total += decode_time_ms(active_kv_fraction)
    return total
