"""Load metrics published on the ``kv_metrics`` topic (at least once a second and on change)."""

from __future__ import annotations

import msgspec


class KvTierLoad(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One lower KV tier (host memory, disk) of one rank: occupancy now, traffic since start."""

    blocks: int = 0  # blocks the tier holds
    total_blocks: int = 0  # its capacity
    usage: float = 0.0  # blocks / total_blocks
    hit_tokens: int = 0  # prompt tokens onboarded from this tier instead of recomputed
    onboarded_blocks: int = 0  # blocks copied from this tier back to the device
    offloaded_blocks: int = 0  # blocks that moved into this tier


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
    # Lower KV tiers by medium ("CPU", "DISK"; kv_events.MEDIA), when the engine has them; the
    # device cache is ``kv_usage``/``total_blocks`` above.
    kv_tiers: dict[str, KvTierLoad] | None = None
    # Encode pool (issue 26). An encode worker (role ``encode``, component ``encoder``) reports its
    # encoder over the last publishing interval; the KV fields above stay at their defaults.
    encoder_busy: float = 0.0  # encoder seconds per wall second (0..1: the share of time it encoded)
    encode_images_per_s: float = 0.0  # images encoded per second
    encode_inflight_images: int = 0  # images queued or being encoded now
    # An agg/prefill worker of a vision-language model: its embedding cache (by image content
    # hash), cumulative since start. Both 0 on a text-only worker, and then left out on the wire.
    embedding_cache_hits: int = 0  # images whose embedding was already cached (no read)
    embedding_cache_misses: int = 0  # images whose embedding was read from an encode worker


load_encoder = msgspec.msgpack.Encoder()
load_decoder = msgspec.msgpack.Decoder(LoadMetrics)
