"""The standalone KV router's service: the workers it routes to and its two endpoints.

``generate`` takes a ``PreprocessedRequest``, picks a worker of the worker component with the
``KvRouter``, forwards the request to that worker's ``generate`` and streams the worker's outputs
back. The router counts the request on the worker from the pick until the stream ends (prefill
done at the first output; freed at the end, on an error, or when the caller cancels, which also
cancels the worker's stream). The first output frame carries ``worker_id`` and ``dp_rank`` so the
caller learns where the request went (extra keys; ``EngineOutput`` decoders ignore them).

``best_worker_id`` takes a ``BestWorkerRequest`` (``{token_ids, lora_name?, overlap_weight?,
temperature?, stage?}``) and answers a ``BestWorkerAnswer`` (``{worker_id, dp_rank, overlap_blocks,
explain}``, ``explain`` the whole ``RoutingDecision``; both in ``shared/protocol/best_worker.py``)
without counting anything: for callers that send the request themselves. ``stage`` ``prefill``
asks the prefill pool; ``decode`` the decode pool as a remotely prefilled request sees it (the
policy's ``decode_overlap_weight`` for remote prompts unless given).

Disaggregated serving: when the prefill component (``--prefill-component``, default ``prefill``)
has published a prefill card, or a decode-role worker is among the workers, ``generate`` runs
the prefill stage first (``prefill_stage.PrefillStage``, the very code the frontend runs: policy,
one retry on another prefill worker, local fallback or 503), then routes the decode stage and
forwards the request with the prefill worker's ``disaggregated_params``. The first output frame
then also carries ``disagg`` (the decision) and ``prefill_worker_id``.

Workers: the ready instances of ``{namespace}/{worker_component}/generate``. A worker's model card
(same key layout under ``v1/mdc``, followed by one ``ModelCardSet`` for the namespace, which also
hands the prefill workers' cards to the prefill pool) gives the block size, data-parallel size and KV
capacity, and its LoRA cards the adapters it serves: a request naming an adapter is routed only
among the workers holding it. The router's block size is ``--kv-block-size`` or the first card's;
a worker with another block size cannot share this index and is not routed to (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from dynamod.daemon.router.core.config import KvRouterConfig
from dynamod.daemon.router.core.decision_publisher import DecisionPublisher
from dynamod.daemon.router.core.feed import KvFeed
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.daemon.router.core.prefill_stage import (
    DecodeHint,
    PrefillOutcome,
    PrefillStage,
    close_drains,
    decode_body,
)
from dynamod.daemon.router.core.worker_load import decode_load
from dynamod.daemon.router.prefill_pool import RouterPrefillPool
from dynamod.shared.drain import InFlight
from dynamod.shared.errors import DynamoError, InvalidRequestError, NoInstancesError, NotFoundError
from dynamod.shared.observability import tracing
from dynamod.shared.observability.traces_endpoint import serve_traces
from dynamod.shared.protocol import control
from dynamod.shared.protocol.best_worker import BestWorkerAnswer, BestWorkerRequest
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import mdc_prefix, parse_key
from dynamod.shared.protocol.llm import PreprocessedRequest
from dynamod.shared.protocol.model_card import ModelCard
from dynamod.shared.protocol.routing import STAGE_DECODE, STAGE_PREFILL, RoutingDecision
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.distributed import deregister_all, mark_all_draining
from dynamod.shared.runtime.model_cards import ModelCardSet
from dynamod.shared.transport.plane import RequestContext

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient
    from dynamod.shared.runtime.distributed import DistributedRuntime, ServedInstance

logger = logging.getLogger(__name__)

GENERATE = "generate"
BEST_WORKER_ID = "best_worker_id"
ROLE = "router"
DECODE_ROLE = "decode"


@dataclass(frozen=True, slots=True)
class RouterServiceConfig:
    router_component: str = "router"
    worker_component: str = "backend"
    prefill_component: str | None = "prefill"  # None: no disaggregated serving
    block_size: int | None = None  # None: from the first worker's model card
    worker_wait_s: float = 5.0  # a request waits this long for a first routable worker
    decision_sample_rate: float = 1.0


class RouterService:
    """``start()`` serves the endpoints; ``stop(grace_s)`` deregisters and lets streams finish."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        kv_config: KvRouterConfig,
        config: RouterServiceConfig,
        prefill_stage: PrefillStage | None = None,
    ) -> None:
        self._rt = runtime
        self.kv_config = kv_config
        self.config = config
        self.feed = KvFeed(runtime, kv_config, sync_component=config.router_component)
        self.decisions = DecisionPublisher(runtime, config.router_component, sample_rate=config.decision_sample_rate)
        self.prefill_stage = prefill_stage
        self.prefill: RouterPrefillPool | None = None
        if config.prefill_component and prefill_stage is not None:
            self.prefill = RouterPrefillPool(runtime, kv_config, self.feed, self.decisions, config.prefill_component)
        self._decode_role = False  # a decode-role worker: disaggregated even before any prefill card
        self.kv: KvRouter | None = None
        self._client: EndpointClient | None = None
        self.card_set = ModelCardSet(runtime.store, mdc_prefix(runtime.settings.namespace))
        self.card_set.add_listener(self._on_card)
        self._cards: dict[int, ModelCard] = {}  # worker id -> its base model card
        self._loras: dict[int, set[str]] = {}  # worker id -> LoRA adapters it serves
        self._dp_size: dict[int, int] = {}  # workers in the router (routed to while ready) -> dp ranks
        self._rejected: set[int] = set()  # workers whose block size differs from the router's
        self._changed = asyncio.Event()
        self._served: list[ServedInstance] = []
        self._ids = itertools.count()
        self._inflight = InFlight()
        if config.block_size is not None:
            self._make_router(config.block_size)

    @property
    def namespace(self) -> str:
        return self._rt.settings.namespace

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.feed.start()
        await self.decisions.start()
        component = self._rt.namespace().component(self.config.worker_component)
        client = await component.endpoint(GENERATE).client()
        self._client = client
        client.instance_set.add_listener(self._on_instance)
        if self.prefill is not None:
            await self.prefill.start()
        await self.card_set.start()  # after the clients: a card's worker is looked up in them
        router = self._rt.namespace().component(self.config.router_component)
        self._served.append(await router.endpoint(GENERATE).serve(self._generate, role=ROLE))
        self._served.append(await router.endpoint(BEST_WORKER_ID).serve(self._best_worker_id, role=ROLE))
        self._served.append(await router.endpoint(control.TRACES).serve(serve_traces, role=ROLE))
        logger.info(
            "router serving namespace=%s router_component=%s worker_component=%s block_size=%s workers=%d",
            self.namespace, self.config.router_component, self.config.worker_component,
            self.kv.block_size if self.kv else "from-card", len(client.instances),
        )

    @property
    def inflight(self) -> int:
        """Requests being served now."""
        return self._inflight.count

    async def stop(self, grace_s: float) -> None:
        """Marks its records draining (callers stop sending new work), waits up to ``grace_s``
        for streams in flight, deregisters, then closes. Deregistering first would make every
        caller fail its open streams over at once."""
        await mark_all_draining(self._served)
        await self._inflight.drain(grace_s, "router")
        await deregister_all(self._served)
        await self.card_set.close()
        if self._client is not None:
            await self._client.close()
        if self.prefill is not None:
            await self.prefill.close()
        await self.decisions.close()
        await self.feed.close()

    # -- workers ----------------------------------------------------------------------------------
    #
    # A worker is routable when its generate instance is ready and its base model card is known
    # (with this router's block size); its LoRA cards say which adapters it can serve.

    def _make_router(self, block_size: int) -> KvRouter:
        kv = KvRouter(self.kv_config, block_size, registry=self._rt.registry, on_resync=self.feed.request_resync)
        self.kv = kv
        self.feed.add_router(self.config.worker_component, kv)
        return kv

    def _on_instance(self, key: str, inst: Instance | None) -> None:
        if inst is not None and inst.role == DECODE_ROLE:
            self._decode_role = True
        parsed = parse_key(key)
        if parsed is not None:
            self._reconcile(parsed.instance_id)

    @property
    def disaggregated(self) -> bool:
        """Decode workers with a prefill pool (or declared as decode workers) get the prefill stage."""
        return self.prefill is not None and (self.prefill.seen or self._decode_role)

    def _on_card(self, key: str, card: ModelCard | None) -> None:
        """The namespace's cards: the worker component's are ours, the prefill component's the
        prefill pool's; the others (other components, other endpoints) are not routed to here."""
        parsed = parse_key(key)
        if parsed is None or parsed.name != GENERATE:
            return
        wid, lora = parsed.instance_id, parsed.lora
        if parsed.component == self.config.worker_component:
            if card is None:
                self._card_deleted(wid, lora)
            else:
                self._card_put(wid, lora, card)
        if self.prefill is not None and parsed.component == self.prefill.component:
            if card is None:
                self.prefill.card_deleted(wid, lora)
            else:
                self.prefill.card_put(wid, lora, card)

    def _card_put(self, wid: int, lora: str | None, card: ModelCard) -> None:
        if lora is not None:
            self._loras.setdefault(wid, set()).add(lora)
            return
        kv = self.kv if self.kv is not None else self._make_router(card.kv_block_size)
        if card.kv_block_size != kv.block_size:
            if wid not in self._rejected:
                self._rejected.add(wid)
                logger.warning(
                    "router ignores worker with another block size worker_id=%016x block_size=%d router_block_size=%d",
                    wid, card.kv_block_size, kv.block_size,
                )
            return
        self._cards[wid] = card
        self._reconcile(wid)

    def _card_deleted(self, wid: int, lora: str | None) -> None:
        if lora is not None:
            self._loras.get(wid, set()).discard(lora)
            return
        self._cards.pop(wid, None)
        self._rejected.discard(wid)
        self._loras.pop(wid, None)
        self._reconcile(wid)

    def _reconcile(self, wid: int) -> None:
        """Adds or removes ``wid`` in the router as its instance and card come and go."""
        card = self._cards.get(wid)
        present = card is not None and self._client is not None and self._client.instance_set.get(wid) is not None
        kv = self.kv
        if present and wid not in self._dp_size:
            assert kv is not None and card is not None
            dp = max(1, card.runtime_config.data_parallel_size)
            self._dp_size[wid] = dp
            total = card.runtime_config.total_kv_blocks
            if total:
                for rank in range(dp):
                    kv.set_worker_capacity((wid, rank), total)
            self.feed.add_worker(kv, wid, self.config.worker_component)
            logger.info("router worker added worker_id=%016x model=%s dp_size=%d", wid, card.served_model_name, dp)
        elif not present and wid in self._dp_size:
            del self._dp_size[wid]
            if kv is not None:
                self.feed.remove_worker(kv, wid)
            logger.info("router worker left worker_id=%016x", wid)
        self._refresh()

    def _refresh(self) -> None:
        """The router's candidates follow the ready workers (draining and sleeping ones get none)."""
        keys: list[tuple[int, int]] = []
        if self._client is not None:
            for inst in self._client.routable:
                dp = self._dp_size.get(inst.instance_id)
                if dp is not None:
                    keys.extend((inst.instance_id, rank) for rank in range(dp))
        if self.kv is not None:
            self.kv.update_workers(keys)
        self._rt.ready_probe_extra["workers"] = len({w for w, _ in keys})
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def _wait_for_workers(self) -> KvRouter:
        deadline = time.monotonic() + self.config.worker_wait_s
        while self.kv is None or not self.kv.workers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoInstancesError(
                    f"no ready worker of {self.namespace}/{self.config.worker_component} "
                    f"(waited {self.config.worker_wait_s:.1f}s)"
                )
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                continue
        return self.kv

    def _allowed(self, kv: KvRouter, lora_name: str | None) -> list[tuple[int, int]] | None:
        """Candidates for a LoRA request: the workers holding that adapter (None: any worker)."""
        if not lora_name:
            return None
        allowed = [w for w in kv.workers if lora_name in self._loras.get(w[0], ())]
        if not allowed:
            # NotFound (404), like an unknown model at the frontend; it also survives the request
            # plane as its own class, so callers can tell it from "no worker at all".
            raise NotFoundError(
                f"no ready worker of {self.namespace}/{self.config.worker_component} has LoRA adapter {lora_name!r}"
            )
        return allowed

    # -- endpoints --------------------------------------------------------------------------------

    async def _generate(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        try:
            request = msgspec.convert(body, PreprocessedRequest)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"bad generate request: {exc}") from None
        self._inflight.enter()
        # This router's span of the request: a child of the caller's (traceparent), parent of the
        # routing decision and of the worker's span; unsampled, it still passes the flag along.
        span = tracing.tracer().start_span(
            tracing.SPAN_HANDLE_PAYLOAD, component=ROLE, parent=tracing.headers_context(ctx.headers),
            attributes={"request_id": tracing.headers_request_id(ctx.headers) or request.request_id,
                        "model": request.model, "role": ROLE, "engine_request_id": request.request_id,
                        "prompt_tokens": len(request.token_ids)},
        )
        try:
            # aclosing: a cancelled caller must free the request and cancel the worker's stream
            # now, not whenever the abandoned inner generator is collected.
            async with contextlib.aclosing(self._route_and_stream(request, ctx, span)) as outputs:
                async for out in outputs:
                    yield out
        except Exception as exc:
            span.fail(exc)
            raise
        finally:
            span.end()
            self._inflight.leave()

    async def _route_and_stream(
        self, request: PreprocessedRequest, ctx: RequestContext, span: tracing.Span
    ) -> AsyncIterator[Any]:
        kv = await self._wait_for_workers()
        key = request.request_id
        if key in kv.active:
            key = f"{request.request_id}#{next(self._ids)}"  # two callers chose the same id
        allowed = self._allowed(kv, request.lora_name)
        drains: list[asyncio.Task[None]] = []
        try:
            outcome: PrefillOutcome | None = None
            if self.disaggregated:
                assert self.prefill_stage is not None and self.prefill is not None
                prefill = tracing.tracer().child(span, tracing.SPAN_PREFILL)
                with tracing.use_span(prefill or span):
                    outcome = await self.prefill_stage.run(
                        request, self.prefill, lambda: self._decode_hint(kv, request, allowed), model=request.model,
                        drains=drains,
                    )
                if prefill is not None:
                    prefill.update({"remote": outcome.remote, **tracing.flat_attributes("disagg", outcome.info.explain())})
                    if outcome.pick is not None:
                        prefill.set("worker_id", worker_id_hex(outcome.pick.worker_id))
                    prefill.end()
            routed_at = time.time_ns()
            decision = await kv.select_worker_waiting(
                key, request.token_ids, lora_name=request.lora_name, allowed=allowed,
                overlap_weight=None if outcome is None or self.prefill_stage is None
                else self.prefill_stage.policy.decode_overlap_weight(outcome.remote),
                priority=request.priority,
                kv_arriving=outcome is not None and outcome.remote,  # its KV is fetched: load from its first token
                local_prefill=None if outcome is None or outcome.remote or self.prefill_stage is None
                else self.prefill_stage.local_prefill,
            )
            if outcome is not None:
                decision.stage = STAGE_DECODE
                decision.disagg = outcome.info
            self.decisions.offer(decision, request.model)
            route = tracing.tracer().child(span, tracing.SPAN_ROUTE, stage=decision.stage)
            if route is not None:
                route.start_unix_ns = routed_at
                route.update(tracing.flat_attributes("router", decision.explain()))
                route.set("router.detail", decision.detail)
                route.end()
            span.set("worker_id", worker_id_hex(decision.worker_id))
            async with contextlib.aclosing(self._forward(kv, key, request, decision, outcome, ctx, span)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            await close_drains(drains)

    async def _forward(
        self, kv: KvRouter, key: str, request: PreprocessedRequest, decision: RoutingDecision,
        outcome: PrefillOutcome | None, ctx: RequestContext, span: tracing.Span,
    ) -> AsyncIterator[Any]:
        wid, rank = decision.worker_id, decision.dp_rank
        try:
            assert self._client is not None
            inst = self._client.instance_set.get(wid)
            if inst is None:
                raise NoInstancesError(f"worker {wid:x} left before the request reached it")
            forward = msgspec.structs.replace(
                request, dp_rank=rank, estimated_prefix_hit_blocks=decision.overlap_blocks or None
            )
            if outcome is not None:
                forward = decode_body(forward, outcome)
            with tracing.use_span(span):  # the worker's span is a child of this router's
                stream = self._client.stream_to(inst, forward, request_id=request.request_id, timeout_s=ctx.time_left())
            try:
                first = True
                async for out in stream:
                    if first:
                        first = False
                        kv.mark_prefill_done(key)
                        if outcome is not None and self.prefill_stage is not None:
                            self.prefill_stage.first_token(outcome)
                        if isinstance(out, dict):
                            out = {**out, "worker_id": wid, "dp_rank": rank}
                            if outcome is not None:
                                out["disagg"] = msgspec.to_builtins(outcome.info)
                                if outcome.remote and outcome.pick is not None:
                                    out["prefill_worker_id"] = outcome.pick.worker_id
                    if outcome is not None and outcome.cached_tokens is not None and isinstance(out, dict):
                        usage = out.get("usage")
                        if isinstance(usage, dict):  # the client is told the prefill worker's cache hits
                            out = {**out, "usage": {**usage, "cached_tokens": outcome.cached_tokens}}
                    yield out
            finally:
                await stream.aclose()  # a cancelled caller cancels the worker's stream
        finally:
            kv.free(key)

    def _decode_hint(self, kv: KvRouter, request: PreprocessedRequest, allowed: list[tuple[int, int]] | None) -> DecodeHint:
        """The decode worker normal KV routing would pick: what it caches, queues and runs."""
        try:
            decision = kv.best_worker(request.request_id, request.token_ids, lora_name=request.lora_name, allowed=allowed)
        except DynamoError:
            return DecodeHint()
        load = decode_load(kv, decision, len(request.token_ids))
        stage = self.prefill_stage
        transfer = None if stage is None else stage.transfer_estimate(decision.worker_id, load.transfer_ms_p50)
        return DecodeHint(load.cached_tokens, load.kv_fraction, decision.worker_id, load.queued_tokens, load.running, transfer)

    async def _best_worker_id(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        try:
            req = msgspec.convert(body, BestWorkerRequest)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"bad best_worker_id request: {exc}") from None
        request_id = req.request_id or f"best-{next(self._ids)}"
        if req.stage not in (None, STAGE_PREFILL, STAGE_DECODE):
            raise InvalidRequestError(f"stage must be {STAGE_PREFILL!r} or {STAGE_DECODE!r}, got {req.stage!r}")
        if req.stage == STAGE_PREFILL:
            if self.prefill is None:
                raise InvalidRequestError("this router serves no prefill pool (--prefill-component is off)")
            decision = self.prefill.best(request_id, req.token_ids, req.lora_name)
        else:
            kv = await self._wait_for_workers()
            weight = req.overlap_weight
            if req.stage == STAGE_DECODE and weight is None and self.prefill_stage is not None:
                weight = self.prefill_stage.policy.decode_overlap_weight(remote=True)
            decision = kv.best_worker(
                request_id,
                req.token_ids,
                lora_name=req.lora_name,
                overlap_weight=weight,
                temperature=req.temperature,
                allowed=self._allowed(kv, req.lora_name),
            )
            if req.stage == STAGE_DECODE:
                decision.stage = STAGE_DECODE
        yield BestWorkerAnswer.of(decision)
