"""``--router-mode kv``: the frontend's adapter around ``dynamod.daemon.router.KvRouter``.

One ``KvRouter`` per base model (its block size comes from the model card); the model's LoRA
adapters share it and pass their adapter name, which changes the block hashes exactly as the
workers' KV events do. This module feeds the routers what they need and the frontend's dispatch
does not know about:

- KV events (``kv-events``) and load (``kv_metrics``) of every component the models are served
  from, subscribed when a model's first worker on that component appears;
- the workers of each model as they come and go (``remove_worker`` when one leaves for good), and
  a fresh worker's cached blocks read from its ``kv_dump`` endpoint, as is any worker whose event
  stream had a gap;
- with several frontends (``--num-frontends`` or ``--router-replica-sync``), each router's
  active-sequence changes published on ``namespace/frontend/active_sequences_events`` and the
  other frontends' changes applied, so every frontend counts every request's load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from dynamod.daemon.frontend.routing import RouteChoice, RouteRequest
from dynamod.daemon.router import KvRouter, KvRouterConfig, config_from_args
from dynamod.shared.errors import DynamoError
from dynamod.shared.events.plane import (
    TOPIC_ACTIVE_SEQUENCES,
    TOPIC_KV_EVENTS,
    TOPIC_KV_METRICS,
    EventPublisher,
)
from dynamod.shared.kv.router_sync import decode_sequence_event, encode_sequence_event
from dynamod.shared.protocol import control
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.kv_events import RouterEvent, router_event_decoder
from dynamod.shared.protocol.load import load_decoder

if TYPE_CHECKING:
    from dynamod.daemon.frontend.models import ModelRegistry, ServedModel
    from dynamod.daemon.frontend.sync import RoutingSync
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

FRONTEND_COMPONENT = "frontend"
_RESYNC_TIMEOUT_S = 30.0


class SyncEnvelope(msgspec.Struct, kw_only=True):
    """Router replica changes of one base model, as ``shared/kv/router_sync`` encodes them."""

    model: str
    events: list[bytes]


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(SyncEnvelope)


class KvGroup:
    """The KV router of one base model and the workers it knows."""

    def __init__(self, base: str, kv: KvRouter, dp_size: int) -> None:
        self.base = base
        self.kv = kv
        self.dp_size = max(1, dp_size)
        self.workers: dict[int, int] = {}  # worker id -> models of this group it serves
        self._keys: frozenset[tuple[int, int]] = frozenset()

    def keys_for(self, candidates: Sequence[Instance]) -> list[tuple[int, int]]:
        dp = self.dp_size
        return [(inst.instance_id, rank) for inst in candidates for rank in range(dp)]

    def ensure(self, keys: list[tuple[int, int]]) -> None:
        """The router's candidate list follows the ready workers the frontend passes in."""
        wanted = frozenset(keys)
        if wanted != self._keys:
            self._keys = wanted
            self.kv.update_workers(keys)


class KvModelRouter:
    """The ``Router`` of one served model (a base model or one of its LoRA adapters)."""

    name = "kv"

    def __init__(self, group: KvGroup, lora_name: str | None) -> None:
        self._group = group
        self._lora = lora_name

    def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        group = self._group
        keys = group.keys_for(candidates)
        group.ensure(keys)
        decision = group.kv.select_worker(request.request_id, request.token_ids, lora_name=self._lora, allowed=keys)
        for inst in candidates:
            if inst.instance_id == decision.worker_id:
                return RouteChoice(inst, dp_rank=decision.dp_rank, overlap_blocks=decision.overlap_blocks)
        raise DynamoError(f"kv router chose worker {decision.worker_id:x}, which is not a candidate")

    def on_first_token(self, request_id: str) -> None:
        self._group.kv.mark_prefill_done(request_id)

    def on_finish(self, request_id: str) -> None:
        self._group.kv.free(request_id)


class KvRouting:
    """Owns the KV routers of this frontend and the event-plane plumbing that feeds them."""

    def __init__(self, args: argparse.Namespace, runtime: DistributedRuntime, sync: RoutingSync) -> None:
        config: KvRouterConfig = config_from_args(args)
        replicas = getattr(args, "num_frontends", 1) > 1 or getattr(args, "frontend_group_pid", None) is not None
        if replicas and not config.router_replica_sync:
            config = dataclasses.replace(config, router_replica_sync=True)
        self.config = config
        self._rt = runtime
        self._registry: ModelRegistry | None = None
        self.groups: dict[str, KvGroup] = {}
        self._by_worker: dict[int, set[KvGroup]] = {}
        self._components: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._resyncing: set[int] = set()
        self._sync_pub: EventPublisher | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def attach(self, registry: ModelRegistry) -> None:
        self._registry = registry
        registry.worker_listeners.append(self._on_worker)

    async def start(self) -> None:
        if self.config.router_replica_sync and self._rt.events is not None:
            component = self._rt.namespace().component(FRONTEND_COMPONENT)
            self._sync_pub = await component.publisher(TOPIC_ACTIVE_SEQUENCES)
            sub = await component.subscribe(TOPIC_ACTIVE_SEQUENCES)
            self._spawn(self._apply_remote(sub), "kv-replica-sync-in")
        logger.info(
            "kv routing started use_kv_events=%s replica_sync=%s overlap_weight=%.2f temperature=%.2f",
            self.config.use_kv_events, self.config.router_replica_sync,
            self.config.overlap_score_weight, self.config.router_temperature,
        )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("kv routing task failed task=%s error=%s", task.get_name(), task.exception())

    # -- routers ------------------------------------------------------------------------------

    def router_for(self, model: ServedModel) -> KvModelRouter:
        card = model.card
        base = card.base_model or model.name
        group = self.groups.get(base)
        if group is None:
            if card.kv_block_size <= 0:
                raise DynamoError(f"model {model.name!r} publishes no kv_block_size; the kv router needs it")
            kv = KvRouter(self.config, card.kv_block_size, registry=self._rt.registry, on_resync=self._request_resync)
            group = KvGroup(base, kv, card.runtime_config.data_parallel_size)
            self.groups[base] = group
            if self._sync_pub is not None:
                self._spawn(self._publish_sync(group), f"kv-replica-sync-out:{base}")
        return KvModelRouter(group, card.lora)

    def _on_worker(self, model: ServedModel, worker_id: int, added: bool) -> None:
        group = self.groups.get(model.card.base_model or model.name)
        if group is None:
            return
        if added:
            group.workers[worker_id] = group.workers.get(worker_id, 0) + 1
            self._by_worker.setdefault(worker_id, set()).add(group)
            total = model.card.runtime_config.total_kv_blocks
            if total:
                for rank in range(group.dp_size):
                    group.kv.set_worker_capacity((worker_id, rank), total)
            pool = model.workers.get(worker_id)
            if pool is not None and pool.component not in self._components:
                self._components.add(pool.component)
                self._spawn(self._subscribe(pool.component), f"kv-events-in:{pool.component}")
            if group.workers[worker_id] == 1 and self.config.use_kv_events:
                group.kv.request_resync(worker_id)  # read what it cached before we saw it
            return
        left = group.workers.get(worker_id, 0) - 1
        if left > 0:
            group.workers[worker_id] = left
            return
        group.workers.pop(worker_id, None)
        groups = self._by_worker.get(worker_id)
        if groups is not None:
            groups.discard(group)
            if not groups:
                del self._by_worker[worker_id]
        group.kv.remove_worker(worker_id)

    # -- events in ----------------------------------------------------------------------------

    async def _subscribe(self, component_name: str) -> None:
        component = self._rt.namespace().component(component_name)
        events = await component.subscribe(TOPIC_KV_EVENTS)
        load = await component.subscribe(TOPIC_KV_METRICS)
        self._spawn(self._apply_load(load), f"kv-load-in:{component_name}")
        logger.info("kv routing subscribed component=%s", component_name)
        async for msg in events:
            try:
                ev = router_event_decoder.decode(msg.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("ignoring malformed kv event component=%s error=%s", component_name, exc)
                continue
            for group in self._by_worker.get(ev.worker_id, ()):
                group.kv.apply_event(ev)

    async def _apply_load(self, sub: Any) -> None:
        async for msg in sub:
            try:
                m = load_decoder.decode(msg.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("ignoring malformed load metrics error=%s", exc)
                continue
            for group in self._by_worker.get(m.worker_id, ()):
                group.kv.apply_load(m)

    # -- resync from kv_dump --------------------------------------------------------------------

    def _request_resync(self, worker_id: int) -> None:
        if worker_id not in self._resyncing:
            self._resyncing.add(worker_id)
            self._spawn(self._resync(worker_id), f"kv-resync:{worker_id:x}")

    async def _resync(self, worker_id: int) -> None:
        try:
            groups = list(self._by_worker.get(worker_id, ()))
            component = None
            if self._registry is not None:
                for model in self._registry.models.values():
                    pool = model.workers.get(worker_id)
                    if pool is not None:
                        component = pool.component
                        break
            if component is None or not groups:
                return
            client = await self._rt.namespace().component(component).endpoint(control.KV_DUMP).client()
            try:
                await client.wait_for_instances(1, 5.0, routable=False)
                frames = await client.call({}, instance_id=worker_id, timeout_s=_RESYNC_TIMEOUT_S)
            finally:
                await client.close()
            events = [msgspec.convert(e, RouterEvent) for f in frames for e in (f.get("events") or [])]
            last = max((e.event_id for e in events), default=None)
            for group in groups:
                group.kv.replace_worker_blocks(worker_id, events, last)
        except (DynamoError, TimeoutError, msgspec.ValidationError) as exc:
            logger.warning("kv resync failed worker_id=%x error=%s", worker_id, exc)
        finally:
            self._resyncing.discard(worker_id)

    # -- replica sync ---------------------------------------------------------------------------

    async def _publish_sync(self, group: KvGroup) -> None:
        assert self._sync_pub is not None
        while True:
            events = await group.kv.next_sync_events()
            envelope = SyncEnvelope(model=group.base, events=[encode_sequence_event(e) for e in events])
            await self._sync_pub.publish(TOPIC_ACTIVE_SEQUENCES, _envelope_encoder.encode(envelope))

    async def _apply_remote(self, sub: Any) -> None:
        async for msg in sub:
            try:
                envelope = _envelope_decoder.decode(msg.payload)
                group = self.groups.get(envelope.model)
                if group is None:
                    continue
                for raw in envelope.events:
                    group.kv.apply_remote(decode_sequence_event(raw))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("ignoring malformed replica sync message error=%s", exc)
