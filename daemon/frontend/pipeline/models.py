"""The models this frontend serves, kept in step with discovery.

A ``ModelCardSet`` on ``v1/mdc/{namespace}/`` sees every model card: a model appears with the first worker
that publishes its card and disappears with the last one's (cards live under the worker's lease,
so a dead worker's cards vanish within one TTL). A LoRA adapter is a card with ``lora`` set: it is
served as its own model name and routed only to the workers holding that card, with the adapter's
name on the engine request.

Workers are reached through one ``EndpointClient`` per (component, endpoint) the cards point at;
its instance set tells which workers are ready (draining and sleeping ones get no new requests).

Prefill cards (model type ``prefill``, component ``prefill``, the decode cards' served name) are
not models of their own: they form the ``PrefillPool`` of the model with that name, and a model
with a prefill pool is served disaggregated. A prefill card may come before the model's first
decode card; its pool waits here until the model appears. A pool outlives its last worker, so a
disaggregated model whose prefill workers are all gone prefills locally (``no_prefill_workers``)
instead of silently turning into an aggregated one; a decode-role worker makes its model
disaggregated in the same way before any prefill worker has shown up.

Encode cards (model type ``encode``, component ``encoder``, endpoint ``encode``) are not models
either: they form the ``EncoderPool`` of the model with that name, which the encode stage sends
images to (pipeline/encode.py); without one, the model's workers encode images themselves.

Embedding cards (model type ``embedding``, endpoint ``embed``) make models of their own kind, kept
apart in ``embedding_models``: ``get`` (chat, completions, responses) and ``get_embedding``
(``/v1/embeddings``) each answer a model of the other kind with a 400 that says which endpoint it
serves. They are routed round-robin over their ready workers (a KV router has nothing to gain
from a one-pass request), so the KV router never hears of them. A name can be one kind only:
a card of the other kind for a name already served is refused with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynamod.daemon.frontend.pipeline.metrics import FrontendMetrics, ModelMetrics
from dynamod.daemon.frontend.pipeline.routing import Quarantine, RoundRobinRouter, Router
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor, PreprocessorCache
from dynamod.shared.errors import InvalidRequestError, NotFoundError
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import mdc_prefix, parse_key
from dynamod.shared.protocol.model_card import (
    MODEL_TYPE_CHAT,
    MODEL_TYPE_COMPLETIONS,
    MODEL_TYPE_EMBEDDING,
    MODEL_TYPE_ENCODE,
    MODEL_TYPE_PREFILL,
    ModelCard,
)
from dynamod.shared.runtime.model_cards import ModelCardSet
from dynamod.shared.runtime.model_files import ModelFilesReader

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

RouterFactory = Callable[["ServedModel"], Router]
PrefillRouterFactory = Callable[["PrefillPool"], Router]
DECODE_ROLE = "decode"


class EndpointPool:
    """The live instances of one (component, endpoint): its client's instance set, which indexes
    them by id for the hot path. A worker that restarts under the same id (new address or start
    time) leaves the quarantine: it gets a fresh chance."""

    def __init__(
        self,
        client: EndpointClient,
        on_change: Callable[[], None],
        quarantine: Quarantine,
        on_instance: Callable[[Instance], None] | None = None,
    ) -> None:
        self.client = client
        self.component = client.component
        self.endpoint = client.endpoint
        self.instances: Mapping[int, Instance] = client.instance_set.by_id  # the set's own index, not a copy
        self._on_change = on_change
        self._quarantine = quarantine
        self._on_instance = on_instance
        # Which run of each worker we saw last: the instance set keeps only the current record,
        # and a restart is told by comparing the two.
        self._runs: dict[int, tuple[str, float]] = {i.instance_id: (i.address, i.started_at) for i in client.instances}
        client.instance_set.add_listener(self._listen)

    def _listen(self, key: str, inst: Instance | None) -> None:
        if inst is not None:
            run = (inst.address, inst.started_at)
            if self._runs.get(inst.instance_id, run) != run:
                self._quarantine.discard(inst.instance_id)  # restarted: give it a fresh chance
            self._runs[inst.instance_id] = run
            if self._on_instance is not None:
                self._on_instance(inst)
        else:
            parsed = parse_key(key)
            if parsed is not None:
                self._runs.pop(parsed.instance_id, None)
                self._quarantine.discard(parsed.instance_id)
        self._on_change()


def _ready(workers: dict[int, EndpointPool], quarantine: Quarantine, exclude: set[int] | frozenset[int]) -> list[Instance]:
    out = []
    for wid, pool in workers.items():
        inst = pool.instances.get(wid)
        if inst is not None and inst.routable and wid not in exclude and wid not in quarantine:
            out.append(inst)
    return out


@dataclass(eq=False)
class PrefillPool:
    """The prefill workers of one served model name, and the router that picks among them.

    ``inflight_tokens`` counts the prompt tokens this frontend has sent to each prefill worker
    and not yet seen the params for: the ``prefill_load`` policy's load where no fresher figure
    (the worker's own load metrics, kv mode) is known."""

    name: str
    card: ModelCard  # the first prefill card seen, else the decode card (block size, LoRA)
    from_prefill_card: bool = False  # False: made for a decode worker before any prefill card
    workers: dict[int, EndpointPool] = field(default_factory=dict)
    router: Router | None = None
    inflight_tokens: dict[int, int] = field(default_factory=dict)

    def candidates(self, quarantine: Quarantine, exclude: set[int] | frozenset[int] = frozenset()) -> list[Instance]:
        """Ready prefill workers, minus ``exclude`` and quarantined ones."""
        return _ready(self.workers, quarantine, exclude)


@dataclass(eq=False)
class EncoderPool:
    """The encode workers of one served model name (cards of model type ``encode``): the frontend
    sends them a request's images (pipeline/encode.py). ``inflight`` counts the images this
    frontend has sent each worker and not had answered: the pool picks the least loaded."""

    name: str
    workers: dict[int, EndpointPool] = field(default_factory=dict)
    inflight: dict[int, int] = field(default_factory=dict)

    def candidates(self, quarantine: Quarantine, exclude: set[int] | frozenset[int] = frozenset()) -> list[Instance]:
        return _ready(self.workers, quarantine, exclude)


@dataclass(eq=False)
class ServedModel:
    """One model name clients can ask for, and the workers that serve it."""

    name: str
    card: ModelCard
    created: int
    metrics: ModelMetrics
    workers: dict[int, EndpointPool] = field(default_factory=dict)
    router: Router | None = None
    preprocessor_task: asyncio.Task[ModelPreprocessor] | None = None
    # Loads the tokenizer again after a failed load (its files were not in discovery yet).
    reload_preprocessor: Callable[[ModelCard], asyncio.Task[ModelPreprocessor]] | None = None
    prefill: PrefillPool | None = None  # set: served disaggregated

    @property
    def lora_name(self) -> str | None:
        return self.card.lora

    @property
    def context_length(self) -> int:
        return self.card.context_length

    def candidates(self, quarantine: Quarantine, exclude: set[int] | frozenset[int] = frozenset()) -> list[Instance]:
        """Ready workers of this model, minus ``exclude`` and quarantined ones."""
        return _ready(self.workers, quarantine, exclude)

    def live_instance(self, worker_id: int) -> tuple[Instance, EndpointPool] | None:
        pool = self.workers.get(worker_id)
        if pool is None:
            return None
        inst = pool.instances.get(worker_id)
        return (inst, pool) if inst is not None else None

    async def preprocessor(self) -> ModelPreprocessor:
        task = self.preprocessor_task
        assert task is not None
        if self.reload_preprocessor is not None and task.done() and not task.cancelled() and task.exception():
            task = self.preprocessor_task = self.reload_preprocessor(self.card)
        return await asyncio.shield(task)


class ModelRegistry:
    """Watches model cards; answers "which model is X" and "what changed" for the frontend."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        metrics: FrontendMetrics,
        quarantine: Quarantine,
        router_factory: RouterFactory,
        prefill_router_factory: PrefillRouterFactory | None = None,
    ) -> None:
        self._rt = runtime
        self.metrics = metrics
        self._quarantine = quarantine
        self._router_factory = router_factory
        self._prefill_router_factory = prefill_router_factory
        self._namespace = runtime.settings.namespace
        self.models: dict[str, ServedModel] = {}  # chat/completions models
        self.embedding_models: dict[str, ServedModel] = {}
        self._cards: dict[str, tuple[str, int]] = {}  # card key -> (model name, worker id)
        self._prefill_cards: dict[str, tuple[str, int]] = {}  # prefill card key -> (model name, worker id)
        self.prefill_pools: dict[str, PrefillPool] = {}  # model name -> its prefill pool (may precede the model)
        self._encode_cards: dict[str, tuple[str, int]] = {}  # encode card key -> (model name, worker id)
        self.encoder_pools: dict[str, EncoderPool] = {}  # model name -> its encode workers
        self._pools: dict[tuple[str, str], EndpointPool] = {}
        self._pool_lock = asyncio.Lock()
        self._preprocessors = PreprocessorCache(ModelFilesReader(runtime.store, self._namespace))
        self._changed = asyncio.Event()
        self.card_set = ModelCardSet(runtime.store, mdc_prefix(self._namespace))
        self.card_set.add_listener(self._on_card)
        self.model_listeners: list[Callable[[ServedModel, bool], None]] = []
        # (model, worker id, added): the KV router starts or stops tracking a worker.
        self.worker_listeners: list[Callable[[ServedModel, int, bool], None]] = []
        # (prefill pool, worker id, added): the prefill router follows the prefill pool.
        self.prefill_listeners: list[Callable[[PrefillPool, int, bool], None]] = []

    async def start(self) -> None:
        # The card set seeds before it returns, so the first request after startup already sees
        # the current models.
        await self.card_set.start()

    async def close(self) -> None:
        await self.card_set.close()
        for pool in self._pools.values():
            await pool.client.close()
        self._pools.clear()

    # -- queries --------------------------------------------------------------------------------

    def get(self, name: str) -> ServedModel:
        """A chat/completions model by name (404 unknown; 400 an embedding model)."""
        return _served(self.models, self.embedding_models, name, "is an embedding model; it serves POST /v1/embeddings only")

    def get_embedding(self, name: str) -> ServedModel:
        """An embedding model by name (404 unknown; 400 a chat/completions model)."""
        return _served(self.embedding_models, self.models, name, "does not serve embeddings; it serves chat and completions")

    def all_models(self) -> list[ServedModel]:
        """Every model clients can name, of both kinds, by name."""
        return sorted([*self.models.values(), *self.embedding_models.values()], key=lambda m: m.name)

    async def wait_changed(self, timeout_s: float) -> bool:
        """Waits until a card or instance changes, up to ``timeout_s``; True if one did."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def pools(self) -> list[EndpointPool]:
        return list(self._pools.values())

    # -- watch ----------------------------------------------------------------------------------

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def _on_card(self, key: str, card: ModelCard | None) -> None:
        """The card set's listener. A ``DynamoError`` here (opening the endpoint's client) makes
        the card set watch again, and so put this card again."""
        if card is None:
            self._apply_delete(key)
        else:
            await self._apply_put(key, card)

    async def _pool(self, component: str, endpoint: str) -> EndpointPool:
        key = (component, endpoint)
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        async with self._pool_lock:
            pool = self._pools.get(key)
            if pool is None:
                client = await self._rt.namespace(self._namespace).component(component).endpoint(endpoint).client()
                pool = EndpointPool(client, self._notify, self._quarantine, self._instance_seen)
                self._pools[key] = pool
                logger.info("watching endpoint component=%s endpoint=%s instances=%d", component, endpoint, len(pool.instances))
            return pool

    async def _apply_put(self, key: str, card: ModelCard) -> None:
        parsed = parse_key(key)
        if parsed is None:
            return
        if MODEL_TYPE_EMBEDDING in card.model_types:
            await self._apply_embedding_put(key, parsed.component, parsed.name, parsed.instance_id, card)
            return
        if MODEL_TYPE_ENCODE in card.model_types:
            await self._apply_encode_put(key, parsed.component, parsed.name, parsed.instance_id, card)
            return
        if not ({MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS} & set(card.model_types)):
            if MODEL_TYPE_PREFILL in card.model_types:
                await self._apply_prefill_put(key, parsed.component, parsed.name, parsed.instance_id, card)
            return  # prefill-only workers are not reachable by clients directly
        name = card.served_model_name
        if name in self.embedding_models:
            logger.warning("model card refused model=%s key=%s reason=served_as_embedding_model", name, key)
            return
        previous = self._cards.get(key)
        if previous is not None and previous[0] != name:
            self._apply_delete(key)
        pool = await self._pool(parsed.component, parsed.name)
        self._cards[key] = (name, parsed.instance_id)
        model = self.models.get(name)
        if model is None:
            model = ServedModel(name=name, card=card, created=int(time.time()), metrics=self.metrics.for_model(name))
            model.preprocessor_task = self._preprocessors.get(card)
            model.reload_preprocessor = self._preprocessors.get
            model.router = self._router_factory(model)
            model.prefill = self.prefill_pools.get(name)
            self.models[name] = model
            logger.info(
                "model added model=%s lora=%s base_model=%s context_length=%d block_size=%d worker_id=%016x",
                name, card.lora, card.base_model, card.context_length, card.kv_block_size, parsed.instance_id,
            )
            for listener in self.model_listeners:
                listener(model, True)
        added = parsed.instance_id not in model.workers
        model.workers[parsed.instance_id] = pool
        inst = pool.instances.get(parsed.instance_id)
        if inst is not None and inst.role == DECODE_ROLE and name not in self.prefill_pools:
            self._ensure_prefill_pool(name, card, from_prefill_card=False)
        if added:
            logger.info("model worker added model=%s worker_id=%016x workers=%d", name, parsed.instance_id, len(model.workers))
            for wl in self.worker_listeners:
                wl(model, parsed.instance_id, True)
        self._notify()

    # -- embedding models -----------------------------------------------------------------------

    async def _apply_embedding_put(self, key: str, component: str, endpoint: str, worker_id: int, card: ModelCard) -> None:
        name = card.served_model_name
        if name in self.models:
            logger.warning("model card refused model=%s key=%s reason=served_as_chat_model", name, key)
            return
        if card.embedding is None:
            logger.warning("model card refused model=%s key=%s reason=embedding_card_without_dimensions", name, key)
            return
        previous = self._cards.get(key)
        if previous is not None and previous[0] != name:
            self._apply_delete(key)
        pool = await self._pool(component, endpoint)
        self._cards[key] = (name, worker_id)
        model = self.embedding_models.get(name)
        if model is None:
            model = ServedModel(name=name, card=card, created=int(time.time()), metrics=self.metrics.for_model(name))
            model.preprocessor_task = self._preprocessors.get(card)
            model.reload_preprocessor = self._preprocessors.get
            model.router = RoundRobinRouter()
            self.embedding_models[name] = model
            logger.info(
                "embedding model added model=%s dimensions=%d context_length=%d worker_id=%016x",
                name, card.embedding.dimensions, card.context_length, worker_id,
            )
        if worker_id not in model.workers:
            model.workers[worker_id] = pool
            logger.info("model worker added model=%s worker_id=%016x workers=%d", name, worker_id, len(model.workers))
        self._notify()

    # -- prefill pools --------------------------------------------------------------------------

    def _ensure_prefill_pool(self, name: str, card: ModelCard, *, from_prefill_card: bool) -> PrefillPool:
        pp = self.prefill_pools.get(name)
        if pp is None:
            pp = PrefillPool(name=name, card=card, from_prefill_card=from_prefill_card)
            pp.router = self._prefill_router_factory(pp) if self._prefill_router_factory else RoundRobinRouter()
            self.prefill_pools[name] = pp
            logger.info(
                "model disaggregated model=%s source=%s", name, "prefill_card" if from_prefill_card else "decode_worker"
            )
        elif from_prefill_card and not pp.from_prefill_card:
            pp.card, pp.from_prefill_card = card, True
            if self._prefill_router_factory is not None:
                pp.router = self._prefill_router_factory(pp)  # now with the prefill card's block size
        model = self.models.get(name)
        if model is not None:
            model.prefill = pp
        return pp

    def _instance_seen(self, inst: Instance) -> None:
        """A decode-role worker makes the models it serves disaggregated (its card may have come first)."""
        if inst.role != DECODE_ROLE:
            return
        for name, wid in list(self._cards.values()):
            model = self.models.get(name)
            if wid == inst.instance_id and model is not None and name not in self.prefill_pools:
                self._ensure_prefill_pool(name, model.card, from_prefill_card=False)

    async def _apply_prefill_put(self, key: str, component: str, endpoint: str, worker_id: int, card: ModelCard) -> None:
        name = card.served_model_name
        previous = self._prefill_cards.get(key)
        if previous is not None and previous[0] != name:
            self._apply_delete(key)
        pool = await self._pool(component, endpoint)
        self._prefill_cards[key] = (name, worker_id)
        pp = self._ensure_prefill_pool(name, card, from_prefill_card=True)
        if worker_id not in pp.workers:
            pp.workers[worker_id] = pool
            logger.info("prefill worker added model=%s worker_id=%016x prefill_workers=%d", name, worker_id, len(pp.workers))
            for pl in self.prefill_listeners:
                pl(pp, worker_id, True)
        self._notify()

    def _apply_prefill_delete(self, key: str) -> bool:
        entry = self._prefill_cards.pop(key, None)
        if entry is None:
            return False
        name, worker_id = entry
        pp = self.prefill_pools.get(name)
        if pp is not None and entry not in self._prefill_cards.values() and pp.workers.pop(worker_id, None) is not None:
            pp.inflight_tokens.pop(worker_id, None)
            logger.info("prefill worker removed model=%s worker_id=%016x prefill_workers=%d", name, worker_id, len(pp.workers))
            for pl in self.prefill_listeners:
                pl(pp, worker_id, False)
        self._notify()
        return True

    # -- encoder pools ----------------------------------------------------------------------------

    async def _apply_encode_put(self, key: str, component: str, endpoint: str, worker_id: int, card: ModelCard) -> None:
        name = card.served_model_name
        previous = self._encode_cards.get(key)
        if previous is not None and previous[0] != name:
            self._apply_delete(key)
        pool = await self._pool(component, endpoint)
        self._encode_cards[key] = (name, worker_id)
        ep = self.encoder_pools.setdefault(name, EncoderPool(name))
        if worker_id not in ep.workers:
            ep.workers[worker_id] = pool
            logger.info("encode worker added model=%s worker_id=%016x encode_workers=%d", name, worker_id, len(ep.workers))
        self._notify()

    def _apply_encode_delete(self, key: str) -> bool:
        entry = self._encode_cards.pop(key, None)
        if entry is None:
            return False
        name, worker_id = entry
        ep = self.encoder_pools.get(name)
        if ep is not None and ep.workers.pop(worker_id, None) is not None:
            ep.inflight.pop(worker_id, None)
            logger.info("encode worker removed model=%s worker_id=%016x encode_workers=%d", name, worker_id, len(ep.workers))
        self._notify()
        return True

    def _apply_delete(self, key: str) -> None:
        if self._apply_prefill_delete(key) or self._apply_encode_delete(key):
            return
        entry = self._cards.pop(key, None)
        if entry is None:
            return
        name, worker_id = entry
        table = self.models if name in self.models else self.embedding_models
        model = table.get(name)
        if model is None:
            return
        # Another card of the same worker (same model) may still be there; only drop on the last.
        if not any(v == entry for v in self._cards.values()) and model.workers.pop(worker_id, None) is not None:
            logger.info("model worker removed model=%s worker_id=%016x workers=%d", name, worker_id, len(model.workers))
            if table is self.models:
                for wl in self.worker_listeners:
                    wl(model, worker_id, False)
        if not model.workers:
            del table[name]
            logger.info("model removed model=%s", name)
            if table is self.models:
                for listener in self.model_listeners:
                    listener(model, False)
        self._notify()


def _served(
    models: Mapping[str, ServedModel], other_kind: Mapping[str, ServedModel], name: str, wrong_kind: str
) -> ServedModel:
    """``models[name]``; a 400 saying ``wrong_kind`` when ``name`` is served as the other kind of
    model (``other_kind``), a 404 when it is not served at all."""
    model = models.get(name)
    if model is None:
        if name in other_kind:
            raise InvalidRequestError(f"the model {name!r} {wrong_kind}", param="model")
        raise NotFoundError(f"the model {name!r} does not exist; GET /v1/models lists the models served now")
    return model
