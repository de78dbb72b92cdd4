"""The models this frontend serves, kept in step with discovery.

A watch on ``v1/mdc/{namespace}/`` sees every model card: a model appears with the first worker
that publishes its card and disappears with the last one's (cards live under the worker's lease,
so a dead worker's cards vanish within one TTL). A LoRA adapter is a card with ``lora`` set: it is
served as its own model name and routed only to the workers holding that card, with the adapter's
name on the engine request.

Workers are reached through one ``EndpointClient`` per (component, endpoint) the cards point at;
its instance watch tells which workers are ready (draining and sleeping ones get no new requests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from dynamod.daemon.frontend.metrics import FrontendMetrics, ModelMetrics
from dynamod.daemon.frontend.preprocessor import ModelPreprocessor, PreprocessorCache
from dynamod.daemon.frontend.routing import Quarantine, Router
from dynamod.shared.discovery.store import WatchEventKind
from dynamod.shared.errors import DynamoError, NotFoundError
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import MDC_ROOT, mdc_prefix, parse_key
from dynamod.shared.protocol.model_card import MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS, ModelCard, decode_card

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

RouterFactory = Callable[["ServedModel"], Router]


class EndpointPool:
    """The live instances of one (component, endpoint), indexed by id for the hot path."""

    def __init__(self, client: EndpointClient, on_change: Callable[[], None], quarantine: Quarantine) -> None:
        self.client = client
        self.component = client.component
        self.endpoint = client.endpoint
        self.instances: dict[int, Instance] = {}
        self._on_change = on_change
        self._quarantine = quarantine
        for inst in client.instances:
            self.instances[inst.instance_id] = inst
        client.instance_set.add_listener(self._listen)

    def _listen(self, key: str, inst: Instance | None) -> None:
        if inst is not None:
            old = self.instances.get(inst.instance_id)
            if old is not None and (old.address != inst.address or old.started_at != inst.started_at):
                self._quarantine.discard(inst.instance_id)  # restarted: give it a fresh chance
            self.instances[inst.instance_id] = inst
        else:
            parsed = parse_key(key)
            if parsed is not None:
                self.instances.pop(parsed.instance_id, None)
                self._quarantine.discard(parsed.instance_id)
        self._on_change()


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

    @property
    def lora_name(self) -> str | None:
        return self.card.lora

    @property
    def context_length(self) -> int:
        return self.card.context_length

    def candidates(self, quarantine: Quarantine, exclude: set[int] | frozenset[int] = frozenset()) -> list[Instance]:
        """Ready workers of this model, minus ``exclude`` and quarantined ones."""
        out = []
        for wid, pool in self.workers.items():
            inst = pool.instances.get(wid)
            if inst is not None and inst.status == "ready" and wid not in exclude and wid not in quarantine:
                out.append(inst)
        return out

    def live_instance(self, worker_id: int) -> tuple[Instance, EndpointPool] | None:
        pool = self.workers.get(worker_id)
        if pool is None:
            return None
        inst = pool.instances.get(worker_id)
        return (inst, pool) if inst is not None else None

    async def preprocessor(self) -> ModelPreprocessor:
        assert self.preprocessor_task is not None
        return await asyncio.shield(self.preprocessor_task)


class ModelRegistry:
    """Watches model cards; answers "which model is X" and "what changed" for the frontend."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        metrics: FrontendMetrics,
        quarantine: Quarantine,
        router_factory: RouterFactory,
    ) -> None:
        self._rt = runtime
        self._metrics = metrics
        self._quarantine = quarantine
        self._router_factory = router_factory
        self._namespace = runtime.settings.namespace
        self.models: dict[str, ServedModel] = {}
        self._cards: dict[str, tuple[str, int]] = {}  # card key -> (model name, worker id)
        self._pools: dict[tuple[str, str], EndpointPool] = {}
        self._pool_lock = asyncio.Lock()
        self._preprocessors = PreprocessorCache()
        self._changed = asyncio.Event()
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.model_listeners: list[Callable[[ServedModel, bool], None]] = []
        # (model, worker id, added): the KV router starts or stops tracking a worker.
        self.worker_listeners: list[Callable[[ServedModel, int, bool], None]] = []

    async def start(self) -> None:
        prefix = mdc_prefix(self._namespace)
        # Seed before serving so the first request after startup already sees current models.
        for key, value in sorted((await self._rt.store.get_prefix(prefix)).items()):
            await self._apply_put(key, value)
        self._synced.set()
        self._task = asyncio.create_task(self._watch(prefix), name="frontend-model-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for pool in self._pools.values():
            await pool.client.close()
        self._pools.clear()

    # -- queries --------------------------------------------------------------------------------

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise NotFoundError(f"the model {name!r} does not exist; GET /v1/models lists the models served now")
        return model

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

    async def _watch(self, prefix: str) -> None:
        while True:
            try:
                async for ev in self._rt.store.watch_prefix(prefix):
                    if ev.kind is WatchEventKind.PUT and ev.value is not None:
                        await self._apply_put(ev.key, ev.value)
                    else:
                        self._apply_delete(ev.key)
                return
            except asyncio.CancelledError:
                raise
            except DynamoError as exc:
                logger.warning("model watch failed error=%s action=retry_in_1s", exc)
                await asyncio.sleep(1.0)

    async def _pool(self, component: str, endpoint: str) -> EndpointPool:
        key = (component, endpoint)
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        async with self._pool_lock:
            pool = self._pools.get(key)
            if pool is None:
                client = await self._rt.namespace(self._namespace).component(component).endpoint(endpoint).client()
                pool = EndpointPool(client, self._notify, self._quarantine)
                self._pools[key] = pool
                logger.info("watching endpoint component=%s endpoint=%s instances=%d", component, endpoint, len(pool.instances))
            return pool

    async def _apply_put(self, key: str, value: bytes) -> None:
        parsed = parse_key(key)
        if parsed is None or parsed.root != MDC_ROOT:
            return
        try:
            card = decode_card(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed model card key=%s error=%s", key, exc)
            return
        if not ({MODEL_TYPE_CHAT, MODEL_TYPE_COMPLETIONS} & set(card.model_types)):
            return  # prefill-only workers are not reachable by clients directly
        name = card.served_model_name
        previous = self._cards.get(key)
        if previous is not None and previous[0] != name:
            self._apply_delete(key)
        pool = await self._pool(parsed.component, parsed.name)
        self._cards[key] = (name, parsed.instance_id)
        model = self.models.get(name)
        if model is None:
            model = ServedModel(name=name, card=card, created=int(time.time()), metrics=self._metrics.for_model(name))
            model.preprocessor_task = self._preprocessors.get(card)
            model.router = self._router_factory(model)
            self.models[name] = model
            logger.info(
                "model added model=%s lora=%s base_model=%s context_length=%d block_size=%d worker_id=%x",
                name, card.lora, card.base_model, card.context_length, card.kv_block_size, parsed.instance_id,
            )
            for listener in self.model_listeners:
                listener(model, True)
        added = parsed.instance_id not in model.workers
        model.workers[parsed.instance_id] = pool
        if added:
            logger.info("model worker added model=%s worker_id=%x workers=%d", name, parsed.instance_id, len(model.workers))
            for wl in self.worker_listeners:
                wl(model, parsed.instance_id, True)
        self._notify()

    def _apply_delete(self, key: str) -> None:
        entry = self._cards.pop(key, None)
        if entry is None:
            return
        name, worker_id = entry
        model = self.models.get(name)
        if model is None:
            return
        # Another card of the same worker (same model) may still be there; only drop on the last.
        if not any(v == entry for v in self._cards.values()) and model.workers.pop(worker_id, None) is not None:
            logger.info("model worker removed model=%s worker_id=%x workers=%d", name, worker_id, len(model.workers))
            for wl in self.worker_listeners:
                wl(model, worker_id, False)
        if not model.workers:
            del self.models[name]
            logger.info("model removed model=%s", name)
            for listener in self.model_listeners:
                listener(model, False)
        self._notify()
