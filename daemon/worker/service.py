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

A worker with a stable name (``--worker-name``) keeps the operator's intent in discovery
(``shared/runtime/intent.py``): drain, sleep (with its level) and loaded LoRA adapters are recorded
after each action succeeded, and re-applied at start *before* any endpoint is served, so a restarted
worker registers straight away as draining or sleeping, with its adapters, and is never ``ready`` in
between. ``wake_up`` and ``unload_lora`` clear what they undo.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from dynamod.daemon.encode.receiver import EmbeddingReceiver, receive_embeddings
from dynamod.daemon.engines.base import EmbeddingEngine, Engine, EngineInfo, KvTransferEngine, LoraInfo
from dynamod.daemon.engines.kv_transfer import KvTransferContext, KvTransferSettings
from dynamod.daemon.worker.kv_transfer import KvTransferStats
from dynamod.daemon.worker.lora_policy import LoraSourcePolicy, check_lora_name
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.shared.discovery.store import Lease
from dynamod.shared.errors import (
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from dynamod.shared.events.plane import TOPIC_KV_EVENTS, TOPIC_KV_METRICS, EventPublisher
from dynamod.shared.kv.transfer.directory import KvTransferDirectory
from dynamod.shared.kv.transfer.factory import create_agent
from dynamod.shared.kv.transfer.peer_warmer import PeerWarmer
from dynamod.shared.observability import tracing
from dynamod.shared.observability.logging import REQUEST_ID as LOG_REQUEST_ID
from dynamod.shared.observability.traces_endpoint import serve_traces
from dynamod.shared.protocol import control
from dynamod.shared.protocol.control import (
    ClearKvRequest,
    DrainRequest,
    EmptyRequest,
    LoadLoraRequest,
    SleepRequest,
    UnloadLoraRequest,
    parse_body,
)
from dynamod.shared.protocol.embedding import EMBED_ENDPOINT, EmbedRequest
from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUS_READY, STATUS_SLEEPING
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.kv_events import MEDIA, router_event_encoder
from dynamod.shared.protocol.llm import PreprocessedRequest
from dynamod.shared.protocol.load import LoadMetrics, load_encoder
from dynamod.shared.protocol.model_card import MODEL_TYPE_EMBEDDING, ModelCard, encode_card
from dynamod.shared.protocol.planner import POOL_DECODE, POOL_ROLE
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.distributed import Component, ServedInstance, deregister_all, mark_all_draining
from dynamod.shared.runtime.intent import IntentRecorder
from dynamod.shared.transport.plane import RequestContext

logger = logging.getLogger(__name__)

T = TypeVar("T")

GENERATE = "generate"
_KV_DUMP_CHUNK = 2000
_LOAD_POLL_S = 0.1
_LOAD_MAX_INTERVAL_S = 1.0


def check_generate_limits(request: PreprocessedRequest, context_length: int) -> None:
    """The worker's own limits, whoever the caller (a frontend, a router, a script on the request
    plane): an empty prompt, a prompt the engine's context cannot hold or an output budget out of
    range is refused here with a 400-class error (``ContextLengthError`` for the context, which the
    frontend relays as a 400 and never migrates), not handed to the engine, where it would fail
    mid-batch or be silently cut short. ``context_length`` 0: not known, only the ranges are checked."""
    prompt = request.token_ids
    if not prompt:
        raise InvalidRequestError("the prompt has no tokens", param="prompt")
    prompt_len = len(prompt)
    if context_length and prompt_len >= context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {context_length} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for the completion. Please shorten the prompt.",
            param="messages",
        )
    stop = request.stop
    max_tokens = stop.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if context_length and prompt_len + max_tokens > context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {context_length} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                param="max_tokens",
            )
    if stop.min_tokens is not None and (stop.min_tokens < 0 or (max_tokens is not None and stop.min_tokens > max_tokens)):
        raise InvalidRequestError(
            f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {stop.min_tokens}", param="min_tokens"
        )


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
        intent: IntentRecorder | None = None,
        lora_policy: LoraSourcePolicy | None = None,
    ) -> None:
        self.component = component
        self.embeddings: EmbeddingReceiver | None = None  # set by the worker for a VL model (encode pool)
        # Where adapters may come from; the default (no root) loads none (``lora_policy``).
        self.lora_policy = lora_policy or LoraSourcePolicy()
        self.engine = engine
        self._card_builder = card_builder
        self.card: ModelCard | None = None
        self.lease = lease
        self.role = role
        self.status = STATUS_READY
        self.sleep_level = 0  # the level the engine was put to sleep at (0 while not sleeping)
        self._intent = intent  # None: no stable worker name, nothing outlives the process
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
        self._peer_warmer: PeerWarmer | None = None

    @property
    def worker_id(self) -> int:
        return self.lease.id

    @property
    def namespace(self) -> str:
        return self.component.namespace.name

    @property
    def model_endpoint(self) -> str:
        """Where the model is served and its cards live: ``embed`` for an embedding model, else
        ``generate`` (a frontend reaches the workers of a card through the card's endpoint)."""
        if self.card is not None and MODEL_TYPE_EMBEDDING in self.card.model_types:
            return EMBED_ENDPOINT
        return GENERATE

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()
        # Real engines learn their KV geometry (blocks, block size, context) only once started.
        self.card = self._card_builder(self.engine.info)
        if self.model_endpoint == EMBED_ENDPOINT and not isinstance(self.engine, EmbeddingEngine):
            raise ConfigError(f"engine {type(self.engine).__name__} cannot embed; --model-type embedding needs one that can")
        if self._kv_settings is not None:
            await self._start_kv_transfer(self._kv_settings)
        self._kv_pub = await self.component.publisher(TOPIC_KV_EVENTS)
        self._load_pub = await self.component.publisher(TOPIC_KV_METRICS)
        self._tasks.append(asyncio.create_task(self._publish_kv_events(), name=f"kv-events-{self.worker_id:x}"))
        self._tasks.append(asyncio.create_task(self._publish_load(), name=f"load-{self.worker_id:x}"))
        handlers = {
            self.model_endpoint: self._embed if self.model_endpoint == EMBED_ENDPOINT else self._generate,
            control.CLEAR_KV_BLOCKS: self._clear_kv_blocks,
            control.SLEEP: self._sleep,
            control.WAKE_UP: self._wake_up,
            control.DRAIN: self._drain,
            control.LOAD_LORA: self._load_lora,
            control.UNLOAD_LORA: self._unload_lora,
            control.LIST_LORAS: self._list_loras,
            control.KV_DUMP: self._kv_dump,
            control.TRACES: serve_traces,
        }
        # Cards first: a frontend that sees the instance must find its model.
        await self._put_card(None, self.card)
        # Intent before serving: the records are born with the status the operator left.
        status = await self._restore_intent()
        self._metrics.status(self.worker_id, status)  # from the start, not only after a change: alerts read it
        labels = {"worker_name": self._intent.worker_name} if self._intent is not None else None
        for name, handler in handlers.items():
            served = await self.component.endpoint(name).serve(
                handler, lease=self.lease, role=self.role, model=self.card.served_model_name, labels=labels, status=status
            )
            self._served.append(served)
        logger.info(
            "worker registered worker_id=%016x role=%s status=%s model=%s block_size=%d total_blocks=%d",
            self.worker_id,
            self.role,
            status,
            self.card.served_model_name,
            self.card.kv_block_size,
            self.card.runtime_config.total_kv_blocks,
        )

    async def stop(self, grace_s: float) -> None:
        """Marks the endpoints draining (routers stop sending), lets in-flight requests finish up
        to ``grace_s``, deregisters, then stops the engine. The records stay until the requests
        finished: a client fails its streams to an instance the moment its record goes."""
        await mark_all_draining(self._served)  # not _set_status: no operator intent to record
        for lora in self.engine.list_loras():
            await self.component.runtime.store.delete(self._card_key(lora.name))
        await self.component.runtime.store.delete(self._card_key(None))
        deadline = time.monotonic() + grace_s
        if not await self._wait_idle(grace_s):
            logger.warning("stopping with requests in flight worker_id=%016x count=%d", self.worker_id, self.engine.num_active_requests)
        await deregister_all(self._served)
        if self._intent is not None:
            await self._intent.close()
        ctx = self.kv_transfer
        if ctx is not None:
            # Decode workers may still be reading the prompts this worker prefilled.
            if not await self._wait_until(lambda: ctx.stats.held_blocks == 0, deadline - time.monotonic()):
                logger.warning("stopping with kv blocks held worker_id=%016x held_blocks=%d", self.worker_id, ctx.stats.held_blocks)
            await self._withdraw_kv_transfer()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.engine.stop()
        if self._peer_warmer is not None:
            await self._peer_warmer.close()
        if ctx is not None:
            await ctx.agent.close()
        if self._kv_directory is not None:
            await self._kv_directory.close()
        logger.info("worker stopped worker_id=%016x", self.worker_id)

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
                "kv transfer left to the engine's connector worker_id=%016x role=%s engine=%s",
                self.worker_id, self.role, type(engine).__name__,
            )
            return
        assert isinstance(engine, KvTransferEngine)
        agent = create_agent(
            memory, worker_id=self.worker_id, backend=settings.backend, host=settings.host, port=settings.port,
            layout=engine.kv_layout, advertise_host=settings.advertise_host, security=settings.security,
            metrics=self.component.runtime.request_plane_metrics,
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
        if self.role == POOL_ROLE[POOL_DECODE]:  # the reading side: connected to each prefill worker as it appears
            self._peer_warmer = PeerWarmer(agent, directory, settings.peer_component)
            await self._peer_warmer.start()
        meta = agent.metadata()
        logger.info(
            "kv transfer ready worker_id=%016x role=%s backend=%s address=%s blocks=%d block_bytes=%d",
            self.worker_id, self.role, agent.backend, meta.address, meta.num_blocks, meta.block_bytes,
        )

    async def _withdraw_kv_transfer(self) -> None:
        if self._kv_directory is None:
            return
        try:
            await self._kv_directory.withdraw(self.component.name, self.worker_id)
        except Exception as exc:  # the lease ends with the process: the record goes anyway
            logger.warning("kv transfer withdraw failed worker_id=%016x error=%s", self.worker_id, exc)

    # -- operator intent --------------------------------------------------------------------------

    async def _restore_intent(self) -> str:
        """Re-applies the stored intent (adapters, then sleep or drain) and returns the status to
        register with. An adapter that no longer loads (its source gone) is logged and dropped from
        the intent: the worker still serves its base model. A sleep the engine refuses leaves the
        worker ``draining``, which takes no work either, with the intent kept for the operator."""
        recorder = self._intent
        if recorder is None:
            return STATUS_READY
        intent = await recorder.load()
        if intent.empty:
            return STATUS_READY
        dropped: list[str] = []
        for name, source in intent.loras.items():
            try:
                await self._load_adapter(name, source)
            except Exception as exc:  # noqa: BLE001 - any engine's refusal; the base model still serves
                dropped.append(name)
                logger.warning(
                    "intent lora dropped worker_id=%016x worker_name=%s lora=%s source=%s error=%s",
                    self.worker_id, recorder.worker_name, name, source, exc,
                )
        status = intent.status
        if intent.sleeping:
            try:
                await self.engine.sleep(intent.sleep_level)
                self.sleep_level = intent.sleep_level
            except Exception as exc:  # noqa: BLE001 - refusing to start would crash-loop the worker
                status = STATUS_DRAINING
                logger.error(
                    "intent sleep failed, registering draining worker_id=%016x worker_name=%s level=%d error=%s",
                    self.worker_id, recorder.worker_name, intent.sleep_level, exc,
                )
        if dropped:
            await self._record_intent(lambda r: r.remove_loras(dropped, set_by="restart"))
        self.status = status
        self._metrics.status(self.worker_id, status)
        logger.info(
            "intent restored worker_id=%016x worker_name=%s status=%s sleep_level=%d loras=%s dropped=%s",
            self.worker_id, recorder.worker_name, status, self.sleep_level,
            ",".join(n for n in intent.loras if n not in dropped) or "-", ",".join(dropped) or "-",
        )
        return status

    async def _record_intent(self, change: Callable[[IntentRecorder], Awaitable[bool]]) -> bool:
        """Records one intent change after its action succeeded. True once it is in discovery (or
        when this worker keeps no intent); False while discovery does not take it: the recorder
        retries in the background until it does, so the change is late, never lost."""
        if self._intent is None:
            return True
        return await change(self._intent)

    @staticmethod
    def _reply(message: str, saved: bool, **extra: Any) -> dict[str, Any]:
        """``saved`` False: the action took effect here, its status or intent is not in discovery
        yet (it is being retried); the operator is told, and need not do anything."""
        if saved:
            return control.ok(message, **extra)
        return control.ok(
            f"{message}; discovery is not answering, the change is recorded there as soon as it does",
            discovery_pending=True, **extra,
        )

    # -- discovery records ------------------------------------------------------------------------

    def _card_key(self, lora: str | None) -> str:
        return mdc_key(self.namespace, self.component.name, self.model_endpoint, self.worker_id, lora)

    async def _put_card(self, lora: str | None, card: ModelCard) -> None:
        await self.component.runtime.store.put(self._card_key(lora), encode_card(card), self.lease)

    async def _set_status(self, status: str) -> bool:
        """The operator's status change, which a discovery outage must not lose: the worker acts
        on it at once (a draining worker takes no new requests) and each record is written now
        or, when discovery does not take the write (unreachable, disk full), retried in the
        background until it does. Returns False while such a write is pending."""
        # All records at once: during an outage each waits its short while in parallel, not in turn.
        results = await asyncio.gather(*(served.set_status_eventually(status) for served in self._served))
        written = all(results)
        self.status = status
        self._metrics.status(self.worker_id, status)
        return written

    # -- generate -------------------------------------------------------------------------------

    def _admit(self, body: Any, kind: type[T], what: str) -> T:
        """A request this worker takes now: ready, well formed, its LoRA adapter loaded."""
        if self.status != STATUS_READY:
            raise UnavailableError(f"worker {self.worker_id:x} is {self.status}; it takes no new requests")
        try:
            request = msgspec.convert(body, kind)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"bad {what} request: {exc}") from None
        lora = request.lora_name  # type: ignore[attr-defined]
        if lora and lora not in {lo.name for lo in self.engine.list_loras()}:
            raise InvalidRequestError(f"LoRA adapter {lora!r} is not loaded on worker {self.worker_id:x}")
        return request

    async def _generate(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        request = self._admit(body, PreprocessedRequest, "generate")
        assert self.card is not None  # served only after start()
        check_generate_limits(request, self.card.context_length)
        if request.mm_items:  # images an encode worker encoded: read their embeddings first
            request = await receive_embeddings(self.embeddings, request)
        client_id = tracing.headers_request_id(ctx.headers)
        if client_id is not None:
            # This stream's task logs with the client's request id (the task ends with the stream).
            LOG_REQUEST_ID.set(client_id)
        span = self._payload_span(request, ctx)
        if span is None:
            async for out in self.engine.generate(request):
                yield out
            return
        # The engine finds the span by the request's id (its queue, compute and transfer spans
        # are children); the stream's frames tell when the first token and the end came.
        tracing.bind_engine_span(request.request_id, span)
        first = True
        try:
            async for out in self.engine.generate(request):
                if first and getattr(out, "token_ids", None):
                    first = False
                    span.set("ttft_ms", round((time.time_ns() - span.start_unix_ns) / 1e6, 3))
                finish = getattr(out, "finish_reason", None)
                if finish is not None:
                    span.set("finish_reason", finish)
                    usage = getattr(out, "usage", None)
                    if usage is not None:
                        span.set("completion_tokens", usage.completion_tokens)
                        span.set("cached_tokens", getattr(usage, "cached_tokens", None))
                yield out
        except BaseException as exc:
            if isinstance(exc, GeneratorExit | asyncio.CancelledError):
                span.set("cancelled", True)
            else:
                span.fail(exc)
            raise
        finally:
            tracing.unbind_engine_span(request.request_id)
            span.end()

    def _payload_span(self, request: PreprocessedRequest, ctx: RequestContext) -> tracing.Span | None:
        """This worker's span of one request: Dynamo's ``handle_payload``, a child of the caller's
        span (``traceparent``), recording as the caller decided (a caller without one: this
        process's sampler). None when nobody records it (the engine then pays nothing more)."""
        parent = tracing.headers_context(ctx.headers)
        if parent is not None and not parent.sampled:
            return None  # the caller does not record this request (its span would not be kept)
        tr = tracing.tracer()
        worker_hex = worker_id_hex(self.worker_id)
        span = tr.start_span(
            tracing.SPAN_HANDLE_PAYLOAD,
            component=self.role if self.role in tracing.COMPONENTS else "agg",
            parent=parent,
            instance_id=worker_hex,
            attributes={
                "request_id": tracing.headers_request_id(ctx.headers) or request.request_id,
                "model": request.model,
                "worker_id": worker_hex,
                "role": self.role,
                "engine_request_id": request.request_id,
                "endpoint": ctx.endpoint,
                "prompt_tokens": len(request.token_ids),
                "prefill_only": bool(request.prefill_only),
                "remote_prefill": request.disaggregated_params is not None and not request.prefill_only,
            },
        )
        return span if span.recording else None

    async def _embed(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        """One reply frame: the vectors of all inputs (``EmbedResponse``)."""
        request = self._admit(body, EmbedRequest, "embed")
        assert isinstance(self.engine, EmbeddingEngine)  # start() refused anything else
        yield await self.engine.embed(request)

    # -- control endpoints ------------------------------------------------------------------------

    async def _clear_kv_blocks(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, ClearKvRequest, control.CLEAR_KV_BLOCKS)
        if req.medium is None:
            cleared = await self.engine.clear_kv_blocks()
        else:
            if req.medium not in MEDIA:
                raise InvalidRequestError(f"unknown KV tier {req.medium!r}; expected one of {', '.join(MEDIA)}")
            cleared = await self.engine.clear_kv_blocks(req.medium)
        where = "every tier" if req.medium is None else f"the {req.medium} tier"
        logger.info("kv cache cleared worker_id=%016x medium=%s blocks=%d", self.worker_id, req.medium or "all", cleared)
        yield control.ok(f"cleared {cleared} cached blocks from {where}", cleared_blocks=cleared, medium=req.medium)

    async def _sleep(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, SleepRequest, control.SLEEP)
        if req.level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {req.level}")
        async with self._status_lock:
            if self.status == STATUS_SLEEPING:
                saved = await self._record_intent(
                    lambda r: r.set_status(STATUS_SLEEPING, self.sleep_level, set_by=control.SLEEP)
                )
                yield self._reply("already sleeping", saved, state=self.status, level=self.sleep_level)
                return
            # The engine may refuse (no sleep mode on this platform): only then is the worker asleep.
            await self.engine.sleep(req.level)
            written = await self._set_status(STATUS_SLEEPING)
            self.sleep_level = req.level
            saved = await self._record_intent(lambda r: r.set_status(STATUS_SLEEPING, req.level, set_by=control.SLEEP))
        logger.info("worker sleeping worker_id=%016x level=%d", self.worker_id, req.level)
        yield self._reply(f"sleeping at level {req.level}", written and saved, state=self.status, level=req.level)

    async def _wake_up(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        parse_body(body, EmptyRequest, control.WAKE_UP)
        async with self._status_lock:
            if self.status == STATUS_SLEEPING:
                await self.engine.wake_up()
            written = await self._set_status(STATUS_READY)
            self.sleep_level = 0
            saved = await self._record_intent(lambda r: r.set_status(STATUS_READY, set_by=control.WAKE_UP))
        logger.info("worker awake worker_id=%016x", self.worker_id)
        yield self._reply("awake", written and saved, state=self.status)

    async def _drain(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, DrainRequest, control.DRAIN)
        async with self._status_lock:
            if self.status == STATUS_SLEEPING:
                raise InvalidRequestError("worker is sleeping; wake it before draining")
            written = await self._set_status(STATUS_DRAINING)
            saved = await self._record_intent(lambda r: r.set_status(STATUS_DRAINING, set_by=control.DRAIN)) and written
        logger.info("worker draining worker_id=%016x inflight=%d", self.worker_id, self.engine.num_active_requests)
        if not req.wait:
            yield self._reply("draining", saved, state=self.status, inflight=self.engine.num_active_requests)
            return
        if not await self._wait_idle(req.timeout_s):
            left = self.engine.num_active_requests
            yield control.error(f"drain timed out with {left} requests in flight", state=self.status, inflight=left)
        else:
            logger.info("worker drained worker_id=%016x", self.worker_id)
            yield self._reply("drained", saved, state=self.status, inflight=0)

    async def _load_lora(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, LoadLoraRequest, control.LOAD_LORA)
        uri = req.source if isinstance(req.source, str) else req.source.uri
        info = await self._load_adapter(req.lora_name, uri)
        # Only the checked source (a resolved path inside a root) outlives this call.
        saved = await self._record_intent(lambda r: r.add_lora(info.name, info.source, set_by=control.LOAD_LORA))
        yield self._reply(f"loaded {req.lora_name}", saved, lora_name=info.name, lora_id=info.lora_id)

    async def _load_adapter(self, name: str, source: str) -> LoraInfo:
        """Checks the name and source (``lora_policy``: also for adapters re-applied from intent),
        loads the adapter into the engine and publishes its model card (a LoRA is its own model)."""
        check_lora_name(name)
        checked = self.lora_policy.check(source)
        if checked != source:
            logger.info("lora source resolved worker_id=%016x lora=%s source=%r resolved=%s", self.worker_id, name, source, checked)
        info = await self.engine.load_lora(name, checked)
        assert self.card is not None, "load_lora before start"
        card = msgspec.structs.replace(self.card, served_model_name=name, lora=name, base_model=self.card.served_model_name)
        await self._put_card(name, card)
        logger.info("lora loaded worker_id=%016x lora=%s source=%s", self.worker_id, name, source)
        return info

    async def _unload_lora(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        req = parse_body(body, UnloadLoraRequest, control.UNLOAD_LORA)
        try:
            await self.engine.unload_lora(req.lora_name)
        except NotFoundError:
            # Not loaded yet still remembered (an adapter dropped at restart, an intent out of
            # step): this unload forgets it; otherwise the operator named an adapter not there.
            if self._intent is None or req.lora_name not in self._intent.current.loras:
                raise
        await self.component.runtime.store.delete(self._card_key(req.lora_name))
        logger.info("lora unloaded worker_id=%016x lora=%s", self.worker_id, req.lora_name)
        saved = await self._record_intent(lambda r: r.remove_loras([req.lora_name], set_by=control.UNLOAD_LORA))
        yield self._reply(f"unloaded {req.lora_name}", saved, lora_name=req.lora_name)

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
            if self.embeddings is not None:  # a VL model: its embedding cache rides along
                current = [self.embeddings.stamp_load(m) for m in current]
            if current != last or now - last_sent >= _LOAD_MAX_INTERVAL_S:
                for m in current:
                    m.status = self.status
                    m.ts = time.time()
                    await self._load_pub.publish(TOPIC_KV_METRICS, load_encoder.encode(m))
                    self._metrics.load(m)
                last = [msgspec.structs.replace(m, ts=0.0) for m in current]
                last_sent = now
            await asyncio.sleep(_LOAD_POLL_S)
