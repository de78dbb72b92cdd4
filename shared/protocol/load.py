"""Load metrics published on the ``kv_metrics`` topic (at least once a second and on change)."""

from __future__ import annotations

import msgspec


class LoadMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    worker_id: int
    dp_rank: int = 0
    active_decode_blocks: int = 0  # KV blocks held by running sequences
    active_prefill_tokens: int = 0  # prompt tokens admitted but not yet prefilled
    kv_usage: float = 0.0  # fraction of KV blocks in use (0..1)
    total_blocks: int = 0
    num_waiting: int = 0
    num_running: int = 0
    prefix_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, since start
    status: str = "ready"
    ts: float = 0.0
    # Disaggregated serving (cumulative since start, except the window figures): a decode worker
    # counts what it pulled, a prefill worker what was read from it.
    kv_transfer_bytes: int = 0
    kv_transfers: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_ms_p50: float = 0.0  # over the last transfers (a bounded window)
    kv_transfer_ms_p99: float = 0.0
    kv_held_blocks: int = 0  # prefill: blocks held for decode workers to read


load_encoder = msgspec.msgpack.Encoder()
load_decoder = msgspec.msgpack.Decoder(LoadMetrics)
