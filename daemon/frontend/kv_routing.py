"""``--router-mode kv``: the frontend's adapter around ``dynamod.daemon.router.KvRouter``.

One ``KvRouter`` per base model (its block size comes from the model card); the model's LoRA
adapters share it and pass their adapter name, which changes the block hashes exactly as the
workers' KV events do. What is frontend-specific lives here: which models share a router, and
following the model registry's workers (a worker serving a base model and its adapters counts
once). Feeding the routers (KV events, load, ``kv_dump`` resyncs, replica sync on
``namespace/frontend/active_sequences_events``) is ``dynamod.daemon.router.feed.KvFeed``, shared
with the standalone router role.

Every decision is offered to the ``router_decisions`` publisher (console), and handed to the
request's ``RouteExplain`` slot when the client asked for ``x-dynamo-route-explain``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dynamod.daemon.frontend.router_factory import route_explain
from dynamod.daemon.frontend.routing import RouteChoice, RouteRequest
from dynamod.daemon.router import KvRouter, KvRouterConfig, config_from_args
from dynamod.daemon.router.decision_publisher import DecisionPublisher, sample_rate_from_args
from dynamod.daemon.router.feed import KvFeed
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.instance import Instance

if TYPE_CHECKING:
    from dynamod.daemon.frontend.models import ModelRegistry, ServedModel
    from dynamod.daemon.frontend.sync import RoutingSync
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

FRONTEND_COMPONENT = "frontend"


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

    def __init__(self, group: KvGroup, lora_name: str | None, model: str, decisions: DecisionPublisher) -> None:
        self._group = group
        self._lora = lora_name
        self._model = model
        self._decisions = decisions

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        group = self._group
        keys = group.keys_for(candidates)
        group.ensure(keys)
        # While every worker is busy the request waits in the router's bounded queue
        # (--router-queue-size, --router-queue-timeout-secs), then gets a 503.
        decision = await group.kv.select_worker_waiting(
            request.request_id, request.token_ids, lora_name=self._lora, allowed=keys
        )
        self._decisions.offer(decision, self._model)
        slot = route_explain.get()
        if slot is not None:
            slot.header = decision.to_header()
        for inst in candidates:
            if inst.instance_id == decision.worker_id:
                return RouteChoice(inst, dp_rank=decision.dp_rank, overlap_blocks=decision.overlap_blocks)
        raise DynamoError(f"kv router chose worker {decision.worker_id:x}, which is not a candidate")

    def on_first_token(self, request_id: str) -> None:
        self._group.kv.mark_prefill_done(request_id)

    def on_finish(self, request_id: str) -> None:
        self._group.kv.free(request_id)


class KvRouting:
    """Owns the KV routers of this frontend; ``KvFeed`` feeds them."""

    def __init__(self, args: argparse.Namespace, runtime: DistributedRuntime, sync: RoutingSync) -> None:
        config: KvRouterConfig = config_from_args(args)
        replicas = getattr(args, "num_frontends", 1) > 1 or getattr(args, "frontend_group_pid", None) is not None
        if replicas and not config.router_replica_sync:
            config = dataclasses.replace(config, router_replica_sync=True)
        self.config = config
        self._rt = runtime
        self.groups: dict[str, KvGroup] = {}
        self.feed = KvFeed(runtime, config, sync_component=FRONTEND_COMPONENT)
        self.decisions = DecisionPublisher(runtime, FRONTEND_COMPONENT, sample_rate=sample_rate_from_args(args))

    # -- lifecycle --------------------------------------------------------------------------

    def attach(self, registry: ModelRegistry) -> None:
        registry.worker_listeners.append(self._on_worker)

    async def start(self) -> None:
        await self.feed.start()
        await self.decisions.start()
        logger.info(
            "kv routing started use_kv_events=%s replica_sync=%s overlap_weight=%.2f temperature=%.2f",
            self.config.use_kv_events, self.config.router_replica_sync,
            self.config.overlap_score_weight, self.config.router_temperature,
        )

    async def close(self) -> None:
        await self.decisions.close()
        await self.feed.close()

    # -- routers ------------------------------------------------------------------------------

    def router_for(self, model: ServedModel) -> KvModelRouter:
        card = model.card
        base = card.base_model or model.name
        group = self.groups.get(base)
        if group is None:
            if card.kv_block_size <= 0:
                raise DynamoError(f"model {model.name!r} publishes no kv_block_size; the kv router needs it")
            kv = KvRouter(self.config, card.kv_block_size, registry=self._rt.registry, on_resync=self.feed.request_resync)
            group = KvGroup(base, kv, card.runtime_config.data_parallel_size)
            self.groups[base] = group
            self.feed.add_router(base, kv)
        return KvModelRouter(group, card.lora, model.name, self.decisions)

    def _on_worker(self, model: ServedModel, worker_id: int, added: bool) -> None:
        group = self.groups.get(model.card.base_model or model.name)
        if group is None:
            return
        if added:
            group.workers[worker_id] = group.workers.get(worker_id, 0) + 1
            if group.workers[worker_id] > 1:
                return
            total = model.card.runtime_config.total_kv_blocks
            if total:
                for rank in range(group.dp_size):
                    group.kv.set_worker_capacity((worker_id, rank), total)
            pool = model.workers.get(worker_id)
            if pool is not None:
                self.feed.add_worker(group.kv, worker_id, pool.component)
            return
        left = group.workers.get(worker_id, 0) - 1
        if left > 0:
            group.workers[worker_id] = left
            return
        group.workers.pop(worker_id, None)
        self.feed.remove_worker(group.kv, worker_id)
