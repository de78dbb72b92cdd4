"""The global router's service: how the frontend reaches it, and how it forwards to a pool.

Reached like a worker. As in Dynamo, the global router registers in the public namespace as if it
were a worker of the model, so an ordinary frontend (round-robin) finds it through discovery and
sends it tokenized requests; nothing in the frontend knows about pools. In ``agg`` mode it serves
``{namespace}/{component}/generate`` with a chat/completions model card; in ``disagg`` mode it
serves ``prefill_generate`` with a prefill card and ``decode_generate`` with a chat/completions card,
so the frontend runs its usual prefill-then-decode orchestration against it and each stage picks a
pool of its own kind. The cards are the pools' own (tokenizer, context length, block size), copied
from the first matching card a pool's workers publish (``--model-name``, or the first model seen),
so the global router needs no model files. Its instances carry role ``global-router`` and the label
``pools`` (the pool namespaces, comma-separated), which is how the console lists its pools.

Forwards to the pool's router. Each pool namespace runs its own router (``dynamod --role router``,
``{pool}/router/generate``; ``--pool-component`` names another component, e.g. ``backend`` to skip
the pool router and round-robin over its workers). The request goes unchanged to a ready instance
of the chosen pool; the outputs stream back, the first one tagged with ``pool``.

Retry before the first output. With ``enable_priority_retry``, an attempt that fails before its
pool produced any output (the pool has no ready router, the router cannot reach a worker, the
worker errors or aborts before its first token) is sent to the next pool of
``pool_selection.retry_order``: the faster pools, slowest first. Once an output has gone back to
the caller the request is the pool's: an error after that is the caller's to see (the frontend may
migrate it). Bad requests and passed deadlines are not retried: every pool would answer the same.
When the last pool fails too, an ``unavailable``/transport failure becomes ``pool_unavailable``
(503): the frontend must not mistake a pool's outage for the global router's own and quarantine it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec

from dynamod.daemon.global_router.config import (
    STAGE_AGG,
    STAGE_DECODE,
    STAGE_PREFILL,
    GlobalRouterConfig,
    StagePools,
)
from dynamod.daemon.global_router.metrics import GlobalRouterMetrics
from dynamod.daemon.global_router.pool_selection import RequestTraits, retry_order, select_pool
from dynamod.shared.drain import InFlight
from dynamod.shared.errors import (
    DeadlineExceededError,
    DynamoError,
    InvalidRequestError,
    TransportError,
    UnavailableError,
)
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import mdc_key, mdc_prefix, parse_key
from dynamod.shared.protocol.llm import FINISH_ABORT, FINISH_ERROR, PreprocessedRequest
from dynamod.shared.protocol.model_card import (
    MODEL_TYPE_CHAT,
    MODEL_TYPE_COMPLETIONS,
    MODEL_TYPE_PREFILL,
    ModelCard,
    encode_card,
)
from dynamod.shared.runtime.distributed import deregister_all, mark_all_draining
from dynamod.shared.runtime.model_cards import ModelCardSet
from dynamod.shared.runtime.model_files import ModelFilesPublisher, ModelFilesReader
from dynamod.shared.transport.plane import RequestContext

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient
    from dynamod.shared.runtime.distributed import DistributedRuntime, ServedInstance

logger = logging.getLogger(__name__)

ROLE = "global-router"
POOLS_LABEL = "pools"  # the console reads this label: pool namespaces, comma-separated
ENDPOINTS = {STAGE_AGG: "generate", STAGE_PREFILL: "prefill_generate", STAGE_DECODE: "decode_generate"}
_SERVED_TYPES = (MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS)
_FAILED_FINISHES = (FINISH_ERROR, FINISH_ABORT)


class PoolUnavailableError(DynamoError):
    """Every pool a request was allowed to try failed before its first output.

    Deliberately not an ``UnavailableError``: the frontend migrates those away from the "worker"
    that raised them, and that worker is this global router, which is fine."""

    code = "pool_unavailable"
    http_status = 503


class _FailedBeforeOutput(DynamoError):
    """A pool's first frame was an ``error``/``abort`` finish: a failure, though not an exception."""

    code = "pool_failed"
    http_status = 503


@dataclass(frozen=True, slots=True)
class GlobalRouterServiceConfig:
    component: str = "global_router"  # served in the global router's own (the public) namespace
    pool_component: str = "router"  # what it forwards to in each pool namespace
    pool_endpoint: str = "generate"
    model_name: str | None = None  # None: the first model a pool's workers publish
    default_ttft_target_ms: float | None = None  # None: the middle of the config's TTFT range
    default_itl_target_ms: float | None = None


class GlobalRouterService:
    """``start()`` serves and publishes; ``stop(grace_s)`` deregisters and lets streams finish."""

    def __init__(self, runtime: DistributedRuntime, grid: GlobalRouterConfig, config: GlobalRouterServiceConfig) -> None:
        self._rt = runtime
        self.grid = grid
        self.config = config
        self.metrics = GlobalRouterMetrics(runtime.registry)
        self.model_name = config.model_name
        self._clients: dict[str, EndpointClient] = {}
        self._card_sets: list[ModelCardSet] = []
        self._served: list[ServedInstance] = []
        self._published: dict[str, str] = {}  # stage -> the key of the card published for it
        # The tokenizer files of mirrored cards, kept in our namespace too (frontends look for a
        # card's files in the card's namespace): sha256 -> its publisher.
        self._files: dict[str, ModelFilesPublisher] = {}
        self._stages_of: dict[str, list[str]] = {}  # pool namespace -> the stages it serves
        for stage, pools in grid.stages.items():
            for ns in pools.namespaces:
                self._stages_of.setdefault(ns, []).append(stage)
        self._inflight = InFlight()

    @property
    def namespace(self) -> str:
        return self._rt.settings.namespace

    @property
    def published(self) -> dict[str, str]:
        """Stage -> key of the model card published for it (the frontend sees the model once set)."""
        return dict(self._published)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.grid.check_own_namespace(self.namespace)
        for ns in self.grid.namespaces:
            client = await self._rt.namespace(ns).component(self.config.pool_component).endpoint(self.config.pool_endpoint).client()
            client.instance_set.add_listener(self._on_pool_instance)
            self._clients[ns] = client
        self._refresh_health()
        labels = {POOLS_LABEL: ",".join(self.grid.namespaces), "mode": self.grid.mode}
        component = self._rt.namespace().component(self.config.component)
        for stage in self.grid.stages:
            self._served.append(
                await component.endpoint(ENDPOINTS[stage]).serve(
                    partial(self._handle, stage), role=ROLE, model=self.model_name or "", labels=labels
                )
            )
        # After serving: a published card must point at a live instance.
        for ns in self._stages_of:
            cards = ModelCardSet(self._rt.store, mdc_prefix(ns))
            cards.add_listener(partial(self._on_pool_card, ns))
            self._card_sets.append(cards)
            await cards.start()
        logger.info(
            "global router serving namespace=%s component=%s mode=%s pools=%s pool_target=%s/%s retry=%s model=%s",
            self.namespace, self.config.component, self.grid.mode, ",".join(self.grid.namespaces),
            self.config.pool_component, self.config.pool_endpoint, self.grid.enable_priority_retry,
            self.model_name or "from-first-card",
        )

    @property
    def inflight(self) -> int:
        """Requests being served now."""
        return self._inflight.count

    async def stop(self, grace_s: float) -> None:
        """Marks its records draining and withdraws the cards (frontends stop sending new work),
        waits up to ``grace_s`` for streams in flight, deregisters, then stops following the
        pools. Deregistering first would make the frontends fail their open streams over."""
        await mark_all_draining(self._served)
        for cards in self._card_sets:
            await cards.close()  # first: a card arriving now must not publish ours again
        self._card_sets.clear()
        for key in list(self._published.values()):
            try:
                await self._rt.store.delete(key)
            except DynamoError as exc:
                logger.warning("model card withdraw failed key=%s error=%s", key, exc)
        await self._inflight.drain(grace_s, "global router")
        await deregister_all(self._served)
        for publisher in self._files.values():
            await publisher.close()
        self._files.clear()
        for client in self._clients.values():
            await client.close()

    # -- pools ------------------------------------------------------------------------------------

    def _on_pool_instance(self, key: str, inst: Instance | None) -> None:
        self._refresh_health()

    def _refresh_health(self) -> None:
        """``/health`` shows each pool's ready targets, so an operator sees a pool without a router."""
        self._rt.ready_probe_extra["pools"] = {ns: len(c.routable) for ns, c in self._clients.items()}

    async def _on_pool_card(self, ns: str, key: str, card: ModelCard | None) -> None:
        """Publishes, once per stage, a copy of the first fitting card a pool's workers publish."""
        if card is None or card.lora is not None:
            return  # LoRA adapters are not mirrored: the pool routers would need to agree on them
        parsed = parse_key(key)
        if parsed is None:
            return
        if self.model_name is None:
            self.model_name = card.served_model_name
            logger.info("global router model from pool card model=%s pool=%s", self.model_name, ns)
        if card.served_model_name != self.model_name:
            return
        for stage in self._stages_of.get(ns, ()):
            if stage in self._published:
                continue
            if stage == STAGE_PREFILL:
                types = [MODEL_TYPE_PREFILL]
            else:
                types = [t for t in card.model_types if t in _SERVED_TYPES]
                if not types:
                    continue  # a prefill worker's card says nothing about what clients may ask
            mirrored = msgspec.structs.replace(card, model_types=types)
            await self._mirror_files(ns, card)
            own = mdc_key(self.namespace, self.config.component, ENDPOINTS[stage], self._rt.instance_id)
            await self._rt.store.put(own, encode_card(mirrored), self._rt.lease)
            self._published[stage] = own
            logger.info(
                "global router model published model=%s stage=%s from_pool=%s context_length=%d block_size=%d",
                card.served_model_name, stage, ns, card.context_length, card.kv_block_size,
            )

    async def _mirror_files(self, ns: str, card: ModelCard) -> None:
        """Copies the tokenizer files a pool's card names into our namespace before our copy of
        the card names them (as a worker publishes its files before its card)."""
        ref = card.model_files
        if ref is None or ref.sha256 in self._files or self._rt.lease is None:
            return
        files = await ModelFilesReader(self._rt.store, ns).fetch(ref, model=card.served_model_name)
        publisher = ModelFilesPublisher(self._rt.store, self._rt.lease, self.namespace, files)
        await publisher.start()
        self._files[ref.sha256] = publisher
        logger.info("global router model files mirrored model=%s from_pool=%s sha256=%s",
                    card.served_model_name, ns, ref.sha256[:12])

    # -- requests ---------------------------------------------------------------------------------

    def traits(self, request: PreprocessedRequest) -> RequestTraits:
        """The grid's inputs: the request's targets, else the ``--default-*-target-ms`` flags."""
        targets = request.router
        ttft = targets.ttft_target if targets is not None and targets.ttft_target is not None else None
        itl = targets.itl_target if targets is not None and targets.itl_target is not None else None
        return RequestTraits(
            isl=len(request.token_ids),
            ttft_target_ms=ttft if ttft is not None else self.config.default_ttft_target_ms,
            itl_target_ms=itl if itl is not None else self.config.default_itl_target_ms,
            priority=request.routing.priority if request.routing is not None else None,
        )

    async def _handle(self, stage: str, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        try:
            request = msgspec.convert(body, PreprocessedRequest)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"bad generate request: {exc}") from None
        pools = self.grid.stages[stage]
        traits = self.traits(request)
        choice = select_pool(pools, traits)
        order = retry_order(choice.pool, pools.priorities, self.grid.enable_priority_retry)
        self.metrics.selections.labels(stage, pools.namespaces[choice.pool], choice.reason).inc()
        logger.debug(
            "global router routed request_id=%s stage=%s isl=%d ttft_target_ms=%s itl_target_ms=%s priority=%s "
            "cell=%s pool=%s reason=%s retry_order=%s",
            request.request_id, stage, traits.isl, choice.ttft_target_ms, choice.itl_target_ms, traits.priority,
            list(choice.cell), pools.namespaces[choice.pool], choice.reason,
            ",".join(pools.namespaces[i] for i in order),
        )
        self._inflight.enter()
        gauge = self.metrics.inflight.labels(stage)
        gauge.inc()
        try:
            # aclosing: a cancelled caller cancels the pool's stream now, not at garbage collection.
            async with contextlib.aclosing(self._forward(stage, pools, order, request, ctx)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            gauge.dec()
            self._inflight.leave()

    async def _forward(
        self, stage: str, pools: StagePools, order: list[int], request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[Any]:
        for attempt, index in enumerate(order):
            ns = pools.namespaces[index]
            last = attempt == len(order) - 1
            started = False
            self.metrics.requests.labels(stage, ns).inc()
            try:
                client = self._clients[ns]
                stream = client.stream_to(client.pick(), request, request_id=request.request_id, timeout_s=ctx.time_left())
                try:
                    async for out in stream:
                        if not started:
                            failure = _failure(out)
                            if failure is not None and not last:
                                raise _FailedBeforeOutput(failure)
                            started = True
                            if isinstance(out, dict):
                                out = {**out, "pool": ns}
                        yield out
                finally:
                    await stream.aclose()
                return
            except Exception as exc:
                if started:
                    raise  # the caller has outputs from this pool: it is no longer ours to move
                self.metrics.pool_failures.labels(stage, ns).inc()
                if last or not _retryable(exc):
                    final = _final(exc, stage, ns, attempt)
                    if final is exc:
                        raise
                    raise final from exc
                to = pools.namespaces[order[attempt + 1]]
                self.metrics.retries.labels(stage, ns, to).inc()
                logger.info(
                    "global router retrying request_id=%s stage=%s from_pool=%s to_pool=%s attempt=%d error=%s",
                    request.request_id, stage, ns, to, attempt + 1, exc,
                )


def _failure(out: Any) -> str | None:
    """What went wrong, when a pool's first frame ends the request without any output."""
    if isinstance(out, dict) and out.get("finish_reason") in _FAILED_FINISHES and not out.get("token_ids"):
        return str(out.get("error") or f"finish_reason={out.get('finish_reason')}")
    return None


def _retryable(exc: Exception) -> bool:
    """Another pool would reject a bad request the same way, and a passed deadline stays passed."""
    return not isinstance(exc, InvalidRequestError | DeadlineExceededError)


def _final(exc: Exception, stage: str, ns: str, attempt: int) -> Exception:
    """The error the caller sees once no pool is left: see ``PoolUnavailableError``."""
    if isinstance(exc, TransportError | UnavailableError):
        tried = f" after {attempt + 1} pools" if attempt else ""
        return PoolUnavailableError(f"{stage} pool {ns} failed before its first output{tried}: {exc}")
    return exc
