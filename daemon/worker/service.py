"""One worker: an engine, its served endpoints, its model cards and its event publishing.

``dynamod --role agg|decode|prefill`` runs one of these per engine (``--num-workers N`` runs N in
one process, each with its own lease and so its own instance id). The service owns the worker's
status (ready, draining, sleeping) and keeps the discovery records of all its endpoints in step
with it, so routers and the console see the same thing.

A prefill or decode worker whose engine keeps its KV blocks as memory (``KvTransferEngine``: the
mocker) also runs a KV transfer agent over it: started, and its metadata published under the
worker's lease, before ``generate`` is served (a decode worker handed a prefill worker's
parameters must find its agent), withdrawn and closed at stop after in-flight requests finished
and held blocks were read (or the grace ran out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from dynamod.daemon.worker.control_types import (
    DrainRequest,
    EmptyRequest,
    LoadLoraRequest,
    SleepRequest,
    UnloadLoraRequest,
    parse_body,
)
from dynamod.daemon.worker.engine import Engine, EngineInfo, KvTransferEngine
from dynamod.daemon.worker.kv_transfer import KvTransferContext, KvTransferSettings, KvTransferStats
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.shared.discovery.store import Lease
from dynamod.shared.errors import InvalidRequestError, UnavailableError
from dynamod.shared.events.plane import TOPIC_KV_EVENTS, TOPIC_KV_METRICS, EventPublisher
from dynamod.shared.kv.transfer.directory import KvTransferDirectory
from dynamod.shared.kv.transfer.factory import create_agent
from dynamod.shared.protocol import control
from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUS_READY, STATUS_SLEEPING
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.kv_events import router_event_encoder
from dynamod.shared.protocol.llm import PreprocessedRequest
from dynamod.shared.protocol.load import LoadMetrics, load_encoder
from dynamod.shared.protocol.model_card import ModelCard, encode_card
from dynamod.shared.runtime.distributed import Component, ServedInstance
from dynamod.shared.transport.plane import RequestContext

logger = logging.getLogger(__name__)

GENERATE = "generate"
_KV_DUMP_CHUNK = 2000
_LOAD_POLL_S = 0.1
_LOAD_MAX_INTERVAL_S = 1.0


class WorkerService:
    def __init__(
        self,
        component: Component,
        engine: Engine,
        card_builder: Callable[[EngineInfo], ModelCard],
        lease: Lease,
        *,
        role: str,
        metrics: WorkerMetrics,
        kv_transfer: KvTransferSettings | None = None,
    ) -> None:
        self.component = component
        self.engine = engine
        self._card_builder = card_builder
        self.card: ModelCard | None = None
        self.lease = lease
        self.role = role
        self.status = STATUS_READY
        self._metrics = metrics
        self._served: list[ServedInstance] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._kv_pub: EventPublisher | None = None
        self._load_pub: EventPublisher | None = None
        self._status_lock = asyncio.Lock()
        self._drained = asyncio.Event()
        self._kv_settings = kv_transfer
        self.kv_transfer: KvTransferContext | None = None
        self._kv_directory: KvTransferDirectory | None = None

    @property
    def worker_id(self) -> int:
        return self.lease.id

    @property
    def namespace(self) -> str:
        return self.component.namespace.name

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()
        # Real engines learn their KV geometry (blocks, block size, context) only once started.
        self.card = self._card_builder(self.engine.info)
        if self._kv_settings is not None:
            await self._start_kv_transfer(self._kv_settings)
        self._kv_pub = await self.component.publisher(TOPIC_KV_EVENTS)
        self._load_pub = await self.component.publisher(TOPIC_KV_METRICS)
        self._tasks.append(asyncio.create_task(self._publish_kv_events(), name=f"kv-events-{self.worker_id:x}"))
        self._tasks.append(asyncio.create_task(self._publish_load(), name=f"load-{self.worker_id:x}"))
        handlers = {
            GENERATE: self._generate,
            control.CLEAR_KV_BLOCKS: self._clear_kv_blocks,
            control.SLEEP: self._sleep,
            control.WAKE_UP: self._wake_up,
            control.DRAIN: self._drain,
            control.LOAD_LORA: self._load_lora,
            control.UNLOAD_LORA: self._unload_lora,
            control.LIST_LORAS: self._list_loras,
            control.KV_DUMP: self._kv_dump,
        }
        # Cards first: a frontend that sees the instance must find its model.
        await self._put_card(None, self.card)
        for name, handler in handlers.items():
            served = await self.component.endpoint(name).serve(
                handler, lease=self.lease, role=self.role, model=self.card.served_model_name
            )
            self._served.append(served)
        logger.info(
            "worker ready worker_id=%x role=%s model=%s block_size=%d total_blocks=%d",
            self.worker_id,
            self.role,
            self.card.served_model_name,
            self.card.kv_block_size,
            self.card.runtime_config.total_kv_blocks,
        )

    async def stop(self, grace_s: float) -> None:
        """Deregisters, lets in-flight requests finish up to ``grace_s``, then stops the engine."""
        for served in self._served:
            await served.deregister()
        for lora in self.engine.list_loras():
            await self.component.runtime.store.delete(self._card_key(lora.name))
        await self.component.runtime.store.delete(self._card_key(None))
        deadline = time.monotonic() + grace_s
        if not await self._wait_idle(grace_s):
            logger.warning("stopping with requests in flight worker_id=%x count=%d", self.worker_id, self.engine.num_active_requests)
        ctx = self.kv_transfer
        if ctx is not None:
            # Decode workers may still be reading the prompts this worker prefilled.
            if not await self._wait_until(lambda: ctx.stats.held_blocks == 0, deadline - time.monotonic()):
                logger.warning("stopping with kv blocks held worker_id=%x held_blocks=%d", self.worker_id, ctx.stats.held_blocks)
            await self._withdraw_kv_transfer()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.engine.stop()
        if ctx is not None:
            await ctx.agent.close()
        if self._kv_directory is not None:
            await self._kv_directory.close()
        logger.info("worker stopped worker_id=%x", self.worker_id)

    async def _wait_idle(self, timeout_s: float) -> bool:
        """True once the engine has no request in flight; False if ``timeout_s`` passed first."""
        return await self._wait_until(lambda: not self.engine.num_active_requests, timeout_s)

    @staticmethod
    async def _wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
        """Polled: the engine interface has no idle signal, and 50 ms is far below any drain timeout."""
        deadline = time.monotonic() + timeout_s
        while not done():  # noqa: ASYNC110
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # -- KV transfer (prefill/decode) --------------------------------------------------------------

    async def _start_kv_transfer(self, settings: KvTransferSettings) -> None:
        engine = self.engine
        memory = engine.kv_transfer_memory() if isinstance(engine, KvTransferEngine) else None
        if memory is None:
            logger.info(
                "kv transfer left to the engine's connector worker_id=%x role=%s engine=%s",
                self.worker_id, self.role, type(engine).__name__,
            )
            return
        assert isinstance(engine, KvTransferEngine)
        agent = create_agent(
            memory, worker_id=self.worker_id, backend=settings.backend, host=settings.host, port=settings.port,
            layout=engine.kv_layout,
        )
        await agent.start()
        directory = KvTransferDirectory(self.component.runtime.store, self.namespace)
        try:
            await directory.publish(self.component.name, agent.metadata(), self.lease)
        except BaseException:
            await agent.close()
            await directory.close()
            raise
        ctx = KvTransferContext(
            agent=agent,
            directory=directory,
            stats=KvTransferStats(self.worker_id, agent.backend, self._metrics.kv_transfer),
            settings=settings,
        )
        engine.attach_kv_transfer(ctx)
        self.kv_transfer = ctx
        self._kv_directory = directory
        meta = agent.metadata()
        logger.info(
            "kv transfer ready worker_id=%x role=%s backend=%s address=%s blocks=%d block_bytes=%d",
            self.worker_id, self.role, agent.backend, meta.address, meta.num_blocks, meta.block_bytes,
        )

    async def _withdraw_kv_transfer(self) -> None:
        if self._kv_directory is None:
            return
        try:
            await self._kv_directory.withdraw(self.component.name, self.worker_id)
        except Exception as exc:  # the lease ends with the process: the record goes anyway
            logger.warning("kv transfer withdraw failed worker_id=%x error=%s", self.worker_id, exc)

    # -- discovery records ------------------------------------------------------------------------

    def _card_key(self, lora: str | None) -> str:
        return mdc_key(self.namespace, self.component.name, GENERATE, self.worker_id, lora)

    async def _put_card(self, lora: str | None, card: ModelCard) -> None:
        await self.component.runtime.store.put(self._card_key(lora), encode_card(card), self.lease)

    async def _set_status(self, status: str) -> None:
        # Adopted only once every record says so: after a failed write the worker keeps its old
        # status, so the operator's retry writes again instead of finding nothing to do.
        for served in self._served:
            await served.set_status(status)
        self.status = status
        self._metrics.status(self.worker_id, status)

    # -- generate -------------------------------------------------------------------------------

    async def _generate(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        if self.status != STATUS_READY:
            raise UnavailableError(f"worker {self.worker_id:x} is {self.status}; it takes no new requests")
        try:
            request = msgspec.convert(body, PreprocessedRequest)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"bad generate request: {exc}") from None
        if request.lora_name and request.lora_name not in {lo.name for lo in self.engine.list_loras()}:
            raise InvalidRequestError(f"LoRA adapter {request.lora_name!r} is not loaded on worker {self.worker_id:x}")
        async for out in self.engine.generate(request):
            yield out

    # -- control endpoints ------------------------------------------------------------------------

    async def _clear_kv_blocks(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        parse_body(body, EmptyRequest, control.CLEAR_KV_BLOCKS)
        cleared = await self.engine.clear_kv_blocks()
        logger.info("kv cache cleared worker_id=%x blocks=%d", self.worker_id, cleared)
        yield control.ok(f"cleared {cleared} cached blocks", cleared_blocks=cleared)

    async def _sleep(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, SleepRequest, control.SLEEP)
        if req.level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {req.level}")
        async with self._status_lock:
            if self.status == STATUS_SLEEPING:
                yield control.ok("already sleeping", state=self.status)
                return
            # The engine may refuse (no sleep mode on this platform): only then is the worker asleep.
            await self.engine.sleep(req.level)
            await self._set_status(STATUS_SLEEPING)
        logger.info("worker sleeping worker_id=%x level=%d", self.worker_id, req.level)
        yield control.ok(f"sleeping at level {req.level}", state=self.status)

    async def _wake_up(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        parse_body(body, EmptyRequest, control.WAKE_UP)
        async with self._status_lock:
            if self.status == STATUS_SLEEPING:
                await self.engine.wake_up()
            await self._set_status(STATUS_READY)
        logger.info("worker awake worker_id=%x", self.worker_id)
        yield control.ok("awake", state=self.status)

    async def _drain(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, DrainRequest, control.DRAIN)
        async with self._status_lock:
            if self.status == STATUS_SLEEPING:
                raise InvalidRequestError("worker is sleeping; wake it before draining")
            await self._set_status(STATUS_DRAINING)
        logger.info("worker draining worker_id=%x inflight=%d", self.worker_id, self.engine.num_active_requests)
        if not req.wait:
            yield control.ok("draining", state=self.status, inflight=self.engine.num_active_requests)
            return
        if not await self._wait_idle(req.timeout_s):
            left = self.engine.num_active_requests
            yield control.error(f"drain timed out with {left} requests in flight", state=self.status, inflight=left)
        else:
            logger.info("worker drained worker_id=%x", self.worker_id)
            yield control.ok("drained", state=self.status, inflight=0)

    async def _load_lora(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, LoadLoraRequest, control.LOAD_LORA)
        uri = req.source if isinstance(req.source, str) else req.source.uri
        if not req.lora_name or "/" in req.lora_name:
            raise InvalidRequestError("lora_name must be a non-empty name without '/'")
        info = await self.engine.load_lora(req.lora_name, uri)
        assert self.card is not None, "load_lora before start"
        card = msgspec.structs.replace(
            self.card,
            served_model_name=req.lora_name,
            lora=req.lora_name,
            base_model=self.card.served_model_name,
        )
        await self._put_card(req.lora_name, card)
        logger.info("lora loaded worker_id=%x lora=%s source=%s", self.worker_id, req.lora_name, uri)
        yield control.ok(f"loaded {req.lora_name}", lora_name=info.name, lora_id=info.lora_id)

    async def _unload_lora(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, UnloadLoraRequest, control.UNLOAD_LORA)
        await self.engine.unload_lora(req.lora_name)
        await self.component.runtime.store.delete(self._card_key(req.lora_name))
        logger.info("lora unloaded worker_id=%x lora=%s", self.worker_id, req.lora_name)
        yield control.ok(f"unloaded {req.lora_name}", lora_name=req.lora_name)

    async def _list_loras(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        parse_body(body, EmptyRequest, control.LIST_LORAS)
        loras = [{"name": lo.name, "source": lo.source, "lora_id": lo.lora_id} for lo in self.engine.list_loras()]
        yield control.ok(f"{len(loras)} adapters loaded", loras=loras)

    async def _kv_dump(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        parse_body(body, EmptyRequest, control.KV_DUMP)
        events = await self.engine.kv_dump()
        for i in range(0, len(events), _KV_DUMP_CHUNK):
            yield {"status": control.STATUS_OK, "events": events[i : i + _KV_DUMP_CHUNK]}
        yield control.ok(f"dumped {len(events)} events", done=True, count=len(events))

    # -- publishing -----------------------------------------------------------------------------

    async def _publish_kv_events(self) -> None:
        assert self._kv_pub is not None
        async for ev in self.engine.kv_events():
            await self._kv_pub.publish(TOPIC_KV_EVENTS, router_event_encoder.encode(ev))
            self._metrics.kv_event(self.worker_id, type(ev.event).__name__)

    async def _publish_load(self) -> None:
        """Publishes load on change (polled every 100 ms) and at least once a second."""
        assert self._load_pub is not None
        last: list[LoadMetrics] = []
        last_sent = 0.0
        while True:
            now = time.monotonic()
            current = self.engine.load_metrics()
            if current != last or now - last_sent >= _LOAD_MAX_INTERVAL_S:
                for m in current:
                    m.status = self.status
                    m.ts = time.time()
                    await self._load_pub.publish(TOPIC_KV_METRICS, load_encoder.encode(m))
                    self._metrics.load(m)
                last = [msgspec.structs.replace(m, ts=0.0) for m in current]
                last_sent = now
            await asyncio.sleep(_LOAD_POLL_S)
