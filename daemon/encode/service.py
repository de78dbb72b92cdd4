"""One encode worker: its encoder, the transfer agent over its embedding pages, its ``encode``
endpoint and its model card (model type ``encode``, the base model's served name).

Order at start, as a prefill worker's: the agent serves reads before the card and the endpoint
appear (a frontend that sees the worker may send it images at once, and the reader must reach the
pages it is handed). At stop: the endpoint goes draining and deregisters once in-flight requests
finished, then held pages get the rest of the grace to be read, then the agent closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dynamod.daemon.encode.encoder import BatchStats, MockVisionEncoder
from dynamod.daemon.encode.metrics import EncoderMetrics
from dynamod.shared.discovery.store import Lease
from dynamod.shared.errors import InvalidRequestError, UnavailableError
from dynamod.shared.kv.transfer.base import KvTransferAgent
from dynamod.shared.protocol.encode import (
    EMBEDDING_PAGE_TOKENS,
    ENCODE_ENDPOINT,
    ROLE_ENCODE,
    EncodeReply,
    EncodeRequest,
)
from dynamod.shared.protocol.instance import STATUS_READY
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.model_card import ModelCard, encode_card
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.distributed import Component, ServedInstance, deregister_all, mark_all_draining
from dynamod.shared.transport.plane import RequestContext

logger = logging.getLogger(__name__)

HELD_READ_WAIT_S = 2.0  # at stop: how long held embeddings get to be read


class EncodeService:
    def __init__(
        self,
        component: Component,
        lease: Lease,
        card: ModelCard,
        encoder: MockVisionEncoder,
        agent: KvTransferAgent,
        metrics: EncoderMetrics,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.component = component
        self.lease = lease
        self.card = card
        self.encoder = encoder
        self.agent = agent
        self.metrics = metrics
        self._labels = labels
        self._served: list[ServedInstance] = []
        self._inflight = 0
        self._wid = worker_id_hex(lease.id)
        encoder.on_batch = self._on_batch
        encoder.on_held = lambda n: metrics.held_pages.labels(self._wid).set(n)

    @property
    def worker_id(self) -> int:
        return self.lease.id

    def _card_key(self) -> str:
        return mdc_key(self.component.namespace.name, self.component.name, ENCODE_ENDPOINT, self.worker_id)

    async def start(self) -> None:
        self.agent.set_notify_callback(self.encoder.release)
        await self.agent.start()
        self.encoder.start()
        await self.component.runtime.store.put(self._card_key(), encode_card(self.card), self.lease)
        served = await self.component.endpoint(ENCODE_ENDPOINT).serve(
            self._encode, lease=self.lease, role=ROLE_ENCODE, model=self.card.served_model_name,
            labels=self._labels, status=STATUS_READY,
        )
        self._served.append(served)
        meta = self.agent.metadata()
        logger.info(
            "encode worker registered worker_id=%016x model=%s backend=%s address=%s pages=%d page_bytes=%d",
            self.worker_id, self.card.served_model_name, self.agent.backend, meta.address, meta.num_blocks,
            meta.block_bytes,
        )

    async def stop(self, grace_s: float) -> None:
        await mark_all_draining(self._served)
        await self.component.runtime.store.delete(self._card_key())
        deadline = time.monotonic() + grace_s
        while self._inflight and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # no idle signal: polled, far below any grace
        # Embeddings just handed out are read within milliseconds; one whose reader never came
        # (it encoded the image itself) would otherwise hold the stop until its hold expired.
        deadline = min(deadline, time.monotonic() + HELD_READ_WAIT_S)
        while self.encoder.held_pages and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await deregister_all(self._served)
        await self.encoder.stop()
        await self.agent.close()
        logger.info("encode worker stopped worker_id=%016x", self.worker_id)

    def _on_batch(self, stats: BatchStats) -> None:
        m, wid = self.metrics, self._wid
        m.images.labels(wid).inc(stats.images)
        m.image_tokens.labels(wid).inc(stats.tokens)
        m.seconds.labels(wid).inc(stats.seconds)
        m.batch_seconds.labels(wid).observe(stats.seconds)

    async def _encode(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        try:
            request = msgspec.convert(body, EncodeRequest)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"bad encode request: {exc}") from None
        if request.model != self.card.served_model_name:
            raise InvalidRequestError(f"this encode worker serves {self.card.served_model_name!r}, not {request.model!r}")
        if not request.items:
            raise InvalidRequestError("an encode request needs at least one image")
        most = self.encoder.pages.num_pages * EMBEDDING_PAGE_TOKENS  # what the embedding memory can hold
        for item in request.items:
            if not 0 < item.num_tokens <= most:
                raise InvalidRequestError(f"image {item.mm_hash!r}: num_tokens must be 1..{most}, got {item.num_tokens}")
        self._inflight += 1
        self.metrics.image_bytes.labels(self._wid).inc(sum(len(item.data) for item in request.items))
        inflight = self.metrics.inflight_images.labels(self._wid)
        inflight.inc(len(request.items))
        started = time.monotonic()
        try:
            embeddings = await self.encoder.encode(request.items)
        except UnavailableError:
            self.metrics.failures.labels(self._wid, "full").inc(len(request.items))
            raise
        finally:
            self._inflight -= 1
            inflight.dec(len(request.items))
        self.metrics.requests.labels(self._wid).inc()
        logger.debug("encoded request_id=%s images=%d", request.request_id, len(request.items))
        yield EncodeReply(embeddings=embeddings, encode_ms=(time.monotonic() - started) * 1000.0)
