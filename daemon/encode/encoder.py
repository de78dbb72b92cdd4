"""The encode worker's engine: a batching vision encoder and the holds on its output.

``MockVisionEncoder`` runs as the mocker does: images queue, and one batch at a time takes the
queued images up to ``batch_tokens`` image tokens (at least one image) and costs
``ms_per_image_token`` per token (the mocker's ``--encode-ms-per-image-token``, so an E+PD fleet
and an agg worker encoding locally pay the same for the same image). Each image's embedding goes
into pages of ``EmbeddingPages`` that stay held until the reader's notification (the transfer id)
or ``hold_timeout_s``; the agent serves reads of them meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamod.daemon.encode.pages import EmbeddingPages, mock_embedding, pages_for
from dynamod.shared.errors import UnavailableError
from dynamod.shared.protocol.encode import EmbeddingParams, EncodeItem
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata

logger = logging.getLogger(__name__)

DEFAULT_BATCH_TOKENS = 8192
DEFAULT_HOLD_TIMEOUT_S = 30.0
MAX_QUEUED_IMAGES = 1024


class EncoderFull(UnavailableError):
    """The encoder's queue or its embedding memory is full: the caller tries another worker."""


@dataclass(slots=True)
class _Job:
    item: EncodeItem
    done: asyncio.Future[EmbeddingParams]
    enqueued: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class BatchStats:
    images: int
    tokens: int
    seconds: float


class MockVisionEncoder:
    """Batches images, "encodes" them at a fixed cost per image token, holds the embeddings."""

    def __init__(
        self,
        pages: EmbeddingPages,
        *,
        worker_id: int,
        hidden_size: int,
        ms_per_image_token: float,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
        metadata: Callable[[], KvTransferMetadata],
        on_batch: Callable[[BatchStats], None] | None = None,
        on_held: Callable[[int], None] | None = None,
    ) -> None:
        self.pages = pages
        self.worker_id = worker_id
        self.hidden_size = hidden_size
        self.ms_per_image_token = ms_per_image_token
        self.batch_tokens = max(1, batch_tokens)
        self.hold_timeout_s = hold_timeout_s
        self._metadata = metadata
        self.on_batch = on_batch
        self.on_held = on_held
        self._queue: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._holds: dict[str, tuple[list[int], float]] = {}  # transfer id -> (pages, monotonic deadline)
        self._task: asyncio.Task[None] | None = None

    @property
    def held_pages(self) -> int:
        return sum(len(ids) for ids, _ in self._holds.values())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"encoder-{self.worker_id:x}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for job in self._queue:
            if not job.done.done():
                job.done.set_exception(UnavailableError("the encode worker is stopping"))
        self._queue.clear()

    async def encode(self, items: list[EncodeItem]) -> list[EmbeddingParams]:
        """The params of each item's held embedding, in order (all or an error)."""
        if len(self._queue) + len(items) > MAX_QUEUED_IMAGES:
            raise EncoderFull(f"encoder queue full ({len(self._queue)} images queued)")
        loop = asyncio.get_running_loop()
        jobs = [_Job(item, loop.create_future()) for item in items]
        self._queue.extend(jobs)
        self._wake.set()
        try:
            return list(await asyncio.gather(*(j.done for j in jobs)))
        except BaseException:
            for job in jobs:  # the caller is gone or one image failed: release what the others hold
                if job.done.done() and not job.done.cancelled() and job.done.exception() is None:
                    self.release(job.done.result().transfer_id)
                elif not job.done.done():
                    job.done.cancel()
            raise

    def release(self, transfer_id: str) -> bool:
        """Frees the pages of ``transfer_id`` (the reader's notification); False if not held."""
        held = self._holds.pop(transfer_id, None)
        if held is None:
            return False
        self.pages.free(held[0])
        self._report_held()
        return True

    def _report_held(self) -> None:
        if self.on_held is not None:
            self.on_held(self.held_pages)

    def _expire(self) -> None:
        now = time.monotonic()
        for tid in [t for t, (_, deadline) in self._holds.items() if deadline <= now]:
            self.release(tid)
            logger.info("embedding hold expired worker_id=%016x transfer_id=%s", self.worker_id, tid)

    def _next_batch(self) -> list[_Job]:
        batch: list[_Job] = []
        tokens = 0
        while self._queue:
            job = self._queue[0]
            if job.done.done():  # its request was cancelled
                self._queue.popleft()
                continue
            if batch and tokens + job.item.num_tokens > self.batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += job.item.num_tokens
        return batch

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except TimeoutError:
                    pass
                self._expire()
                continue
            batch = self._next_batch()
            if not batch:
                continue
            tokens = sum(j.item.num_tokens for j in batch)
            seconds = tokens * self.ms_per_image_token / 1000.0
            started = time.monotonic()
            if seconds > 0:
                await asyncio.sleep(seconds)  # the simulated ViT forward of the whole batch
            for job in batch:
                if job.done.done():
                    continue
                try:
                    job.done.set_result(self._hold(job.item))
                except Exception as exc:  # full, or a bad item: this image fails, the loop goes on
                    if not isinstance(exc, EncoderFull):
                        logger.exception("encode failed worker_id=%016x mm_hash=%s", self.worker_id, job.item.mm_hash)
                    job.done.set_exception(exc)
            self._expire()
            if self.on_batch is not None:
                self.on_batch(BatchStats(len(batch), tokens, time.monotonic() - started))

    def _hold(self, item: EncodeItem) -> EmbeddingParams:
        data = mock_embedding(item.mm_hash, item.num_tokens, self.hidden_size)
        ids = self.pages.alloc(pages_for(len(data), self.pages.block_bytes))
        if ids is None:
            self._expire()
            ids = self.pages.alloc(pages_for(len(data), self.pages.block_bytes))
            if ids is None:
                raise EncoderFull(f"embedding memory full ({self.pages.free_pages} of {self.pages.num_pages} pages free)")
        self.pages.write(ids, data)
        transfer_id = uuid.uuid4().hex
        self._holds[transfer_id] = (ids, time.monotonic() + self.hold_timeout_s)
        self._report_held()
        return EmbeddingParams(
            transfer_id=transfer_id, worker_id=self.worker_id, agent=self._metadata(), block_ids=ids,
            num_tokens=item.num_tokens, hidden_size=self.hidden_size, checksum=self.pages.checksum(ids),
            expires_at=time.time() + self.hold_timeout_s,
        )
