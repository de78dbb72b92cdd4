"""The prefill/agg worker's side of the encode pool: read embeddings before the prefill, keep
them in an LRU cache keyed by the image's content hash.

A request whose images carry ``EmbeddingParams`` waits here (as a decode worker waits for remote
KV) while each image's embedding is read from its encode worker into this worker's embedding
pages, all images in parallel, each checked against the sender's checksum. An image already in
the cache is not read again (the encode worker is only told to free its pages). The cache is
bounded in bytes (``--embedding-cache-mb``); the least recently used images go first.

What the engine then sees: ``MultimodalItem.embedding`` stays set on images whose embedding is
here, and is cleared on the others (a failed or timed-out read, a layout this worker cannot take,
or no receiver at all), which the engine encodes itself. The request completes either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import msgspec

from dynamod.daemon.encode.metrics import EmbeddingCacheMetrics
from dynamod.daemon.encode.pages import EmbeddingPages, page_bytes, pages_for
from dynamod.shared.errors import DeadlineExceededError
from dynamod.shared.kv.transfer.base import KvTransferAgent
from dynamod.shared.kv.transfer.factory import create_agent
from dynamod.shared.protocol.encode import EmbeddingParams
from dynamod.shared.protocol.llm import MultimodalItem, PreprocessedRequest
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.transport.liveness import RequestPlaneMetrics

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_CACHE_MB = 64.0
DEFAULT_READ_TIMEOUT_S = 5.0
_NOTIFY_TIMEOUT_S = 2.0


class EmbeddingReadError(Exception):
    """One embedding could not be used; ``reason`` labels the failure metric."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EmbeddingReceiver:
    """Embedding pages, the agent that reads into them, and the LRU index over them."""

    def __init__(
        self,
        pages: EmbeddingPages,
        agent: KvTransferAgent,
        *,
        worker_id: int,
        metrics: EmbeddingCacheMetrics | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        self.pages = pages
        self.agent = agent
        self.worker_id = worker_id
        self.metrics = metrics
        self.read_timeout_s = read_timeout_s
        self._wid = worker_id_hex(worker_id)
        self._cache: OrderedDict[str, list[int]] = OrderedDict()  # mm_hash -> pages, least recent first
        self._reading: dict[str, asyncio.Future[bool]] = {}  # mm_hash -> read under way
        self._tasks: set[asyncio.Task[None]] = set()
        self.hits = 0
        self.misses = 0

    async def start(self) -> None:
        await self.agent.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.agent.close()

    @property
    def cached_bytes(self) -> int:
        return sum(len(ids) for ids in self._cache.values()) * self.pages.block_bytes

    def stamp_load(self, m: LoadMetrics) -> LoadMetrics:
        """The worker's load record with this cache's hits and misses (since start), so the console
        shows the hit rate per worker from the event plane."""
        m.embedding_cache_hits = self.hits
        m.embedding_cache_misses = self.misses
        return m

    def cached(self, mm_hash: str) -> bool:
        return mm_hash in self._cache

    # -- per request ------------------------------------------------------------------------------

    async def receive(self, request: PreprocessedRequest) -> PreprocessedRequest:
        """``request`` with ``embedding`` kept on the images whose embedding is now here."""
        items = request.mm_items or []
        results = await asyncio.gather(*(self._one(item) for item in items))
        if all(results):
            return request
        kept = [item if ok else msgspec.structs.replace(item, embedding=None) for item, ok in zip(items, results, strict=True)]
        return msgspec.structs.replace(request, mm_items=kept)

    async def _one(self, item: MultimodalItem) -> bool:
        params = item.embedding
        if params is None:
            return False
        key = item.mm_hash
        if key in self._cache:
            self._cache.move_to_end(key)
            self._hit(params)
            return True
        pending = self._reading.get(key)
        if pending is not None:  # another request reads the same image: share its read
            ok = await asyncio.shield(pending)
            if ok:
                self._hit(params)
                return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._reading[key] = future
        ok = False
        try:
            ok = await self._read(key, params)
        finally:
            self._reading.pop(key, None)
            future.set_result(ok)
        return ok

    def _hit(self, params: EmbeddingParams) -> None:
        self.hits += 1
        if self.metrics is not None:
            self.metrics.hits.labels(self._wid).inc()
        # The encode worker holds pages for this request: tell it they will not be read.
        task = asyncio.create_task(self._notify(params))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _notify(self, params: EmbeddingParams) -> None:
        try:
            await self.agent.notify(params.agent, params.transfer_id, timeout_s=_NOTIFY_TIMEOUT_S)
        except Exception as exc:  # the hold expires on its own
            logger.debug("embedding notify failed transfer_id=%s error=%s", params.transfer_id, exc)

    async def _read(self, key: str, params: EmbeddingParams) -> bool:
        self.misses += 1
        m = self.metrics
        if m is not None:
            m.misses.labels(self._wid).inc()
        started = time.monotonic()
        local: list[int] | None = None
        try:
            local = self._alloc(params)
            result = await self.agent.read_blocks(
                params.agent, params.block_ids, local, timeout_s=self.read_timeout_s, notify=params.transfer_id,
            )
            if self.pages.checksum(local) != params.checksum:
                raise EmbeddingReadError("checksum", "the embedding read does not match the encoder's checksum")
        except asyncio.CancelledError:  # the request went away mid-read: its pages go back
            if local is not None:
                self.pages.free(local)
            raise
        except Exception as exc:
            if local is not None:
                self.pages.free(local)
            reason = exc.reason if isinstance(exc, EmbeddingReadError) else (
                "timeout" if isinstance(exc, DeadlineExceededError) else "peer_lost"
            )
            if m is not None:
                m.failures.labels(self._wid, reason).inc()
            logger.warning(
                "embedding read failed worker_id=%s mm_hash=%s encoder=%016x reason=%s error=%s action=encode_locally",
                self._wid, key, params.worker_id, reason, exc,
            )
            return False
        self._cache[key] = local
        if m is not None:
            m.read_seconds.labels(self._wid, result.backend).observe(time.monotonic() - started)
            m.read_bytes.labels(self._wid, result.backend).inc(params.num_bytes)
            m.bytes.labels(self._wid).set(self.cached_bytes)
        return True

    def _alloc(self, params: EmbeddingParams) -> list[int]:
        if params.agent.block_bytes != self.pages.block_bytes:
            raise EmbeddingReadError(
                "layout", f"encoder pages of {params.agent.block_bytes} bytes, this worker's of {self.pages.block_bytes}"
            )
        need = pages_for(params.num_bytes, self.pages.block_bytes)
        if need != len(params.block_ids) or need > self.pages.num_pages:
            raise EmbeddingReadError("layout", f"{len(params.block_ids)} pages for {params.num_bytes} bytes")
        while True:
            ids = self.pages.alloc(need)
            if ids is not None:
                return ids
            if not self._cache:
                raise EmbeddingReadError("full", "the embedding cache is busy with reads")
            _, evicted = self._cache.popitem(last=False)
            self.pages.free(evicted)


async def receive_embeddings(receiver: EmbeddingReceiver | None, request: PreprocessedRequest) -> PreprocessedRequest:
    """What a worker does with a request's embedding params before its engine sees it. A
    decode-stage request (KV from a prefill worker) and a worker without a receiver read nothing:
    the params are cleared (the prefill worker read them; the engine encodes, or needs nothing)."""
    items = request.mm_items
    if not items or all(item.embedding is None for item in items):
        return request
    remote_decode = request.disaggregated_params is not None and not request.prefill_only
    if receiver is None or remote_decode:
        return msgspec.structs.replace(
            request, mm_items=[msgspec.structs.replace(item, embedding=None) for item in items]
        )
    return await receiver.receive(request)


async def start_receiver(
    *,
    worker_id: int,
    hidden_size: int,
    cache_mb: float,
    backend: str,
    host: str,
    advertise_host: str | None,
    security: RequestPlaneSecurity | None,
    request_plane_metrics: RequestPlaneMetrics | None,
    metrics: EmbeddingCacheMetrics | None,
) -> EmbeddingReceiver:
    """A started receiver with ``cache_mb`` of embedding pages for ``hidden_size`` embeddings."""
    block_bytes = page_bytes(hidden_size)
    pages = EmbeddingPages(max(1, int(cache_mb * 1024 * 1024) // block_bytes), block_bytes)
    agent = create_agent(
        pages.memory, worker_id=worker_id, backend=backend, host=host, port=0, advertise_host=advertise_host,
        security=security, metrics=request_plane_metrics,
    )
    receiver = EmbeddingReceiver(pages, agent, worker_id=worker_id, metrics=metrics)
    await receiver.start()
    return receiver
