"""The encode stage: a request's images go to the model's encode pool before the prefill.

A model with encode workers (cards of model type ``encode``: ``EncoderPool``) has its images
encoded there, not by the worker that prefills the prompt. The stage runs once the prefilling
worker is known (aggregated: after routing, so an image whose tokens that worker already caches
is not encoded at all: its KV is reused; disaggregated: before the prefill stage, every image),
sends the remaining images of the request as one ``EncodeRequest`` to the least loaded encode
worker, and puts each image's ``EmbeddingParams`` on the request (``MultimodalItem.embedding``),
for the prefilling worker to read (daemon/encode/receiver.py).

Faults: a failed encode call (the worker died, dropped the connection, is full or draining, or
took longer than ``timeout_s``) is tried once more on another encode worker; if that fails too,
or there is no encode worker, the images go without params and the prefilling worker encodes them
itself. The request never fails because of the encode pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

from dynamod.daemon.frontend.pipeline.models import EncoderPool, ModelRegistry
from dynamod.daemon.frontend.pipeline.request import EngineRequest
from dynamod.daemon.frontend.pipeline.routing import Quarantine
from dynamod.shared.errors import DynamoError, TransportError
from dynamod.shared.protocol.encode import EncodeItem, EncodeReply, EncodeRequest
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.llm import MultimodalItem
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.client import EndpointClient, InstanceGoneError

logger = logging.getLogger(__name__)

ENCODE_ATTEMPTS = 2  # the first encode worker, then one other
DEFAULT_ENCODE_TIMEOUT_S = 10.0
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# dynamo_frontend_encode_images{path}: where each image of a request was encoded.
PATH_REMOTE = "remote"  # an encode worker
PATH_CACHED = "cached"  # not at all: the prefilling worker caches the image's tokens
PATH_LOCAL = "local"  # the prefilling worker (no encode pool)
PATH_FALLBACK = "fallback"  # the prefilling worker, after the encode pool failed


class EncodeStageMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.images = Counter(
            "dynamo_frontend_encode_images", "Images of requests by where they were encoded "
            "(remote: an encode worker; cached: nowhere, the routed worker caches their tokens; local: the "
            "prefilling worker, no encode pool; fallback: the prefilling worker after the encode pool failed)",
            ("model", "path"), registry=registry,
        )
        self.seconds = Histogram(
            "dynamo_frontend_encode_seconds", "Wall time of the encode stage (encode call, retries included)",
            ("model",), buckets=_BUCKETS, registry=registry,
        )
        self.failures = Counter(
            "dynamo_frontend_encode_failures", "Encode calls that failed", ("model", "worker_id"), registry=registry,
        )


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, EncodeStageMetrics] = weakref.WeakKeyDictionary()


def stage_metrics(registry: CollectorRegistry) -> EncodeStageMetrics:
    """One set per Prometheus registry (a test may build several frontends on one registry)."""
    metrics = _METRICS.get(registry)
    if metrics is None:
        metrics = _METRICS[registry] = EncodeStageMetrics(registry)
    return metrics


class EncodeStage:
    """Shared by all requests of a frontend."""

    def __init__(
        self,
        registry: ModelRegistry,
        quarantine: Quarantine,
        *,
        timeout_s: float = DEFAULT_ENCODE_TIMEOUT_S,
    ) -> None:
        self.registry = registry
        self.quarantine = quarantine
        self.timeout_s = timeout_s
        self.metrics = stage_metrics(registry.metrics.registry)
        self._turn = 0

    async def run(self, request: EngineRequest, cached_tokens: int) -> None:
        """Encodes the images of ``request`` whose tokens end past ``cached_tokens`` (what the
        prefilling worker caches) and have no embedding yet; sets their params on the request."""
        pre = request.preprocessed
        items = pre.mm_items
        if not items:
            return
        model = request.model.name
        todo = [i for i, item in enumerate(items) if item.embedding is None and item.offset + item.length > cached_tokens]
        skipped = sum(1 for item in items if item.embedding is None) - len(todo)
        if skipped:
            self.metrics.images.labels(model, PATH_CACHED).inc(skipped)
        if not todo:
            return
        pool = self.registry.encoder_pools.get(model)
        if pool is None or not pool.workers:
            self.metrics.images.labels(model, PATH_LOCAL).inc(len(todo))
            return
        started = time.monotonic()
        reply = await self._encode(pool, request.request_id, model, [items[i] for i in todo])
        self.metrics.seconds.labels(model).observe(time.monotonic() - started)
        if reply is None:
            self.metrics.images.labels(model, PATH_FALLBACK).inc(len(todo))
            return
        updated = list(items)
        for i, params in zip(todo, reply.embeddings, strict=True):
            updated[i] = msgspec.structs.replace(items[i], embedding=params)
        request.preprocessed = msgspec.structs.replace(pre, mm_items=updated)
        self.metrics.images.labels(model, PATH_REMOTE).inc(len(todo))

    @staticmethod
    def forget(request: EngineRequest) -> None:
        """Drops the embedding params of an earlier attempt (a migration: the worker that read
        them freed them on the encode worker), so ``run`` encodes the images again."""
        pre = request.preprocessed
        items = pre.mm_items
        if items and any(item.embedding is not None for item in items):
            request.preprocessed = msgspec.structs.replace(
                pre, mm_items=[msgspec.structs.replace(item, embedding=None) for item in items]
            )

    def _pick(self, pool: EncoderPool, tried: set[int]) -> Instance | None:
        candidates = pool.candidates(self.quarantine, tried)
        if not candidates:
            return None
        self._turn += 1
        n = len(candidates)
        # Least loaded by this frontend's in-flight images; ties go round-robin.
        return min(
            (candidates[(self._turn + k) % n] for k in range(n)),
            key=lambda inst: pool.inflight.get(inst.instance_id, 0),
        )

    async def _encode(self, pool: EncoderPool, request_id: str, model: str, items: list[MultimodalItem]) -> EncodeReply | None:
        body = EncodeRequest(request_id=request_id, model=model, items=[
            EncodeItem(mm_hash=item.mm_hash, num_tokens=item.length, width=item.width, height=item.height, data=item.data)
            for item in items
        ])
        tried: set[int] = set()
        for _attempt in range(ENCODE_ATTEMPTS):
            instance = self._pick(pool, tried)
            if instance is None:
                break
            wid = instance.instance_id
            tried.add(wid)
            endpoint = pool.workers.get(wid)
            if endpoint is None:
                continue
            pool.inflight[wid] = pool.inflight.get(wid, 0) + len(items)
            try:
                reply = await asyncio.wait_for(self._call(endpoint.client, instance, body), self.timeout_s)
                if len(reply.embeddings) != len(items):
                    raise ValueError(f"{len(reply.embeddings)} embeddings for {len(items)} images")
                return reply
            except (DynamoError, TimeoutError, ValueError, msgspec.ValidationError) as exc:
                self.metrics.failures.labels(model, worker_id_hex(wid)).inc()
                if isinstance(exc, TransportError) and not isinstance(exc, InstanceGoneError):
                    self.quarantine.add(wid)  # unreachable: skip it until its record goes or it restarts
                logger.warning(
                    "encode failed request_id=%s worker_id=%016x images=%d error=%s: %s action=%s",
                    request_id, wid, len(items), type(exc).__name__, exc,
                    "retry" if _attempt + 1 < ENCODE_ATTEMPTS else "encode_locally",
                )
            finally:
                left = pool.inflight.get(wid, 0) - len(items)
                if left > 0:
                    pool.inflight[wid] = left
                else:
                    pool.inflight.pop(wid, None)
        return None

    @staticmethod
    async def _call(client: EndpointClient, instance: Instance, body: EncodeRequest) -> EncodeReply:
        frames = [f async for f in client.stream_to(instance, body, request_id=body.request_id)]
        if not frames:
            raise ValueError("the encode stream ended without a reply")
        return msgspec.convert(frames[-1], EncodeReply)
