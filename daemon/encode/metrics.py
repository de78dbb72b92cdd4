"""Prometheus metrics of the encode pool: the encode worker's encoder, and the embedding cache and
reads of the prefill/agg workers that receive its output.

Dynamo publishes no encoder or embedding-cache metric under a stable name (its encode workers are
plain ``dynamo_component_*`` endpoints), so these follow its ``dynamo_component_`` prefix and
label by ``worker_id`` like the KV transfer metrics beside them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ENCODE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
READ_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EncoderMetrics:
    """An encode worker's work: requests, images and image tokens encoded, time per batch."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "dynamo_component_encoder_requests", "Encode requests answered", ("worker_id",), registry=registry,
        )
        self.images = Counter(
            "dynamo_component_encoder_images", "Images encoded", ("worker_id",), registry=registry,
        )
        self.image_bytes = Counter(
            "dynamo_component_encoder_image_bytes", "Bytes of the images received (as the clients sent them)",
            ("worker_id",), registry=registry,
        )
        self.image_tokens = Counter(
            "dynamo_component_encoder_image_tokens", "Image tokens encoded", ("worker_id",), registry=registry,
        )
        self.seconds = Counter(
            "dynamo_component_encoder_seconds", "Encoder busy time (seconds, all batches)", ("worker_id",),
            registry=registry,
        )
        self.batch_seconds = Histogram(
            "dynamo_component_encoder_batch_seconds", "Encoder time of one batch", ("worker_id",),
            buckets=ENCODE_BUCKETS, registry=registry,
        )
        self.failures = Counter(
            "dynamo_component_encoder_failures", "Images the encoder could not encode or hold",
            ("worker_id", "reason"), registry=registry,
        )
        self.inflight_images = Gauge(
            "dynamo_component_encoder_inflight_images", "Images queued or being encoded", ("worker_id",),
            registry=registry,
        )
        self.held_pages = Gauge(
            "dynamo_component_encoder_held_pages", "Embedding pages held for prefill workers to read",
            ("worker_id",), registry=registry,
        )


class EmbeddingCacheMetrics:
    """A prefill/agg worker's embedding cache (by image content hash) and its reads from encoders."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.hits = Counter(
            "dynamo_component_embedding_cache_hits", "Images whose embedding was in the cache (no read)",
            ("worker_id",), registry=registry,
        )
        self.misses = Counter(
            "dynamo_component_embedding_cache_misses", "Images whose embedding was read from an encode worker",
            ("worker_id",), registry=registry,
        )
        self.bytes = Gauge(
            "dynamo_component_embedding_cache_bytes", "Bytes of embeddings cached", ("worker_id",), registry=registry,
        )
        self.read_seconds = Histogram(
            "dynamo_component_embedding_transfer_seconds", "Wall time of one embedding read", ("worker_id", "backend"),
            buckets=READ_BUCKETS, registry=registry,
        )
        self.read_bytes = Counter(
            "dynamo_component_embedding_transfer_bytes", "Embedding bytes read from encode workers",
            ("worker_id", "backend"), registry=registry,
        )
        self.failures = Counter(
            "dynamo_component_embedding_transfer_failures",
            "Embedding reads that failed (the worker encoded the image itself)", ("worker_id", "reason"),
            registry=registry,
        )
