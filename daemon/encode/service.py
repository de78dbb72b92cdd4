"""One encode worker: its encoder, the transfer agent over its embedding pages, its ``encode``
endpoint and its model card (model type ``encode``, the base model's served name).

Order at start, as a prefill worker's: the agent serves reads before the card and the endpoint
appear (a frontend that sees the worker may send it images at once, and the reader must reach the
pages it is handed). At stop: the endpoint goes draining and deregisters once in-flight requests
finished, then held pages get the rest of the grace to be read, then the agent closes.

Beside ``encode`` it serves the worker control endpoints, so ``dynamoctl`` works on it as on any
worker: ``drain`` (frontends stop picking it, encodes in flight finish) and ``wake`` (back to
ready) act, the KV/engine/adapter ones answer one clear error. Its load (encoder busy share,
images/s: ``load.py``) goes out on the event plane once a second, for the console.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dynamod.daemon.encode.encoder import BatchStats, MockVisionEncoder
from dynamod.daemon.encode.load import LOAD_INTERVAL_S, EncoderLoad
from dynamod.daemon.encode.metrics import EncoderMetrics
from dynamod.shared.discovery.store import Lease
from dynamod.shared.drain import InFlight
from dynamod.shared.errors import DynamoError, InvalidRequestError, UnavailableError
from dynamod.shared.events.plane import TOPIC_KV_METRICS, EventPublisher
from dynamod.shared.kv.transfer.base import KvTransferAgent
from dynamod.shared.observability import tracing
from dynamod.shared.observability.traces_endpoint import serve_traces
from dynamod.shared.protocol import control
from dynamod.shared.protocol.encode import (
    EMBEDDING_PAGE_TOKENS,
    ENCODE_ENDPOINT,
    ROLE_ENCODE,
    EncodeReply,
    EncodeRequest,
)
from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUS_READY
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.load import load_encoder
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
        load_interval_s: float = LOAD_INTERVAL_S,
    ) -> None:
        self.component = component
        self.lease = lease
        self.card = card
        self.encoder = encoder
        self.agent = agent
        self.metrics = metrics
        self._labels = labels
        self._served: list[ServedInstance] = []
        self._inflight = InFlight()  # encode requests being answered
        self._wid = worker_id_hex(lease.id)
        self.status = STATUS_READY  # draining: takes no new encode requests (a drain, or stopping)
        self._status_lock = asyncio.Lock()
        self.load = EncoderLoad(lease.id)
        self._load_interval_s = load_interval_s
        self._load_pub: EventPublisher | None = None
        self._load_task: asyncio.Task[None] | None = None
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
        self._served.append(await self.component.endpoint(control.TRACES).serve(
            serve_traces, lease=self.lease, role=ROLE_ENCODE, model=self.card.served_model_name,
            labels=self._labels, status=STATUS_READY,
        ))
        for name, handler in self._control_handlers().items():
            self._served.append(await self.component.endpoint(name).serve(
                handler, lease=self.lease, role=ROLE_ENCODE, model=self.card.served_model_name,
                labels=self._labels, status=STATUS_READY,
            ))
        self._load_pub = await self.component.publisher(TOPIC_KV_METRICS)
        self._load_task = asyncio.create_task(self._publish_load(), name=f"encode-load-{self.worker_id:x}")
        meta = self.agent.metadata()
        logger.info(
            "encode worker registered worker_id=%016x model=%s backend=%s address=%s pages=%d page_bytes=%d",
            self.worker_id, self.card.served_model_name, self.agent.backend, meta.address, meta.num_blocks,
            meta.block_bytes,
        )

    async def stop(self, grace_s: float) -> None:
        self.status = STATUS_DRAINING
        await mark_all_draining(self._served)
        await self.component.runtime.store.delete(self._card_key())
        deadline = time.monotonic() + grace_s
        await self._inflight.drain(grace_s, f"encode worker {self._wid}")
        # Embeddings just handed out are read within milliseconds; one whose reader never came
        # (it encoded the image itself) would otherwise hold the stop until its hold expired.
        deadline = min(deadline, time.monotonic() + HELD_READ_WAIT_S)
        while self.encoder.held_pages and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await deregister_all(self._served)
        if self._load_task is not None:
            self._load_task.cancel()
            await asyncio.gather(self._load_task, return_exceptions=True)
        await self.encoder.stop()
        await self.agent.close()
        logger.info("encode worker stopped worker_id=%016x", self.worker_id)

    # -- control endpoints (dynamoctl, the console) -------------------------------------------------

    def _control_handlers(self) -> dict[str, Any]:
        """Every control endpoint but ``traces`` (served above): drain and wake act; the ones about
        KV, engine memory or LoRA adapters answer an error, so ``dynamoctl sleep <encoder>`` says why
        instead of failing to find the endpoint; the two the console reads from every worker
        (``list_loras``, ``kv_dump``) answer the truth, empty."""
        handlers: dict[str, Any] = {
            control.DRAIN: self._drain,
            control.WAKE_UP: self._wake_up,
            control.LIST_LORAS: self._list_loras,
            control.KV_DUMP: self._kv_dump,
        }
        for name in (control.SLEEP, control.CLEAR_KV_BLOCKS, control.LOAD_LORA, control.UNLOAD_LORA):
            handlers[name] = self._unsupported(name)
        assert set(handlers) | {control.TRACES} == set(control.CONTROL_ENDPOINTS), "a control endpoint without a handler"
        return handlers

    @staticmethod
    def _unsupported(name: str) -> Any:
        async def handler(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
            yield control.error(f"{name} is not supported on an encode worker (it holds no KV, engine or adapters)")

        return handler

    async def _set_status(self, status: str) -> bool:
        """Every record of this worker says ``status`` (retried in the background while discovery
        does not take the write). False while such a write is pending."""
        self.status = status
        results = await asyncio.gather(*(served.set_status_eventually(status) for served in self._served))
        return all(results)

    async def _drain(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        """Frontends stop picking this encoder (its records say draining, and it refuses new
        requests); with ``wait`` the reply comes once the encodes in flight finished."""
        req = control.parse_body(body, control.DrainRequest, control.DRAIN)
        async with self._status_lock:
            written = await self._set_status(STATUS_DRAINING)
        logger.info("encode worker draining worker_id=%016x inflight=%d", self.worker_id, self._inflight.count)
        pending = {} if written else {"discovery_pending": True}
        if not req.wait:
            yield control.ok("draining", state=self.status, inflight=self._inflight.count, **pending)
            return
        if not await self._inflight.wait_idle(req.timeout_s):
            left = self._inflight.count
            yield control.error(f"drain timed out with {left} requests in flight", state=self.status, inflight=left)
            return
        logger.info("encode worker drained worker_id=%016x", self.worker_id)
        yield control.ok("drained", state=self.status, inflight=0, held_pages=self.encoder.held_pages, **pending)

    async def _wake_up(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        """Undoes a drain (an encode worker never sleeps)."""
        control.parse_body(body, control.EmptyRequest, control.WAKE_UP)
        async with self._status_lock:
            written = await self._set_status(STATUS_READY)
        logger.info("encode worker ready worker_id=%016x", self.worker_id)
        yield control.ok("awake", state=self.status, **({} if written else {"discovery_pending": True}))

    async def _list_loras(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        control.parse_body(body, control.EmptyRequest, control.LIST_LORAS)
        yield control.ok("0 adapters loaded (an encode worker takes none)", loras=[])

    async def _kv_dump(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        control.parse_body(body, control.EmptyRequest, control.KV_DUMP)
        yield control.ok("dumped 0 events (an encode worker holds no KV)", done=True, count=0)

    # -- load on the event plane --------------------------------------------------------------------

    async def _publish_load(self) -> None:
        """Encoder busy time, images/s and images in flight, once per interval (``load.py``)."""
        assert self._load_pub is not None
        while True:
            await asyncio.sleep(self._load_interval_s)  # a period, not a synchronisation
            m = self.load.report(self.status)
            try:
                await self._load_pub.publish(TOPIC_KV_METRICS, load_encoder.encode(m))
            except DynamoError as exc:  # the event plane away: the next report carries on
                logger.warning("encode load publish failed worker_id=%016x error=%s", self.worker_id, exc)

    def _on_batch(self, stats: BatchStats) -> None:
        self.load.on_batch(stats)
        m, wid = self.metrics, self._wid
        m.images.labels(wid).inc(stats.images)
        m.image_tokens.labels(wid).inc(stats.tokens)
        m.seconds.labels(wid).inc(stats.seconds)
        m.batch_seconds.labels(wid).observe(stats.seconds)

    async def _encode(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        if self.status != STATUS_READY:
            raise UnavailableError(f"encode worker {self._wid} is {self.status}; it takes no new requests")
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
        # This worker's span of the request, a child of the caller's (traceparent).
        span = tracing.tracer().start_span(
            tracing.SPAN_HANDLE_PAYLOAD, component=ROLE_ENCODE, parent=tracing.headers_context(ctx.headers),
            instance_id=self._wid,
            attributes={"request_id": tracing.headers_request_id(ctx.headers) or request.request_id,
                        "model": request.model, "worker_id": self._wid, "role": ROLE_ENCODE,
                        "images": len(request.items), "image_tokens": sum(i.num_tokens for i in request.items)},
        )
        self._inflight.enter()
        self.load.inflight_images += len(request.items)
        self.metrics.image_bytes.labels(self._wid).inc(sum(len(item.data) for item in request.items))
        inflight = self.metrics.inflight_images.labels(self._wid)
        inflight.inc(len(request.items))
        started = time.monotonic()
        try:
            embeddings = await self.encoder.encode(request.items)
        except UnavailableError as exc:
            self.metrics.failures.labels(self._wid, "full").inc(len(request.items))
            span.fail(exc)
            raise
        finally:
            self._inflight.leave()
            self.load.inflight_images -= len(request.items)
            inflight.dec(len(request.items))
            span.end()
        self.metrics.requests.labels(self._wid).inc()
        logger.debug("encoded request_id=%s images=%d", request.request_id, len(request.items))
        yield EncodeReply(embeddings=embeddings, encode_ms=(time.monotonic() - started) * 1000.0)
