"""``--router-mode kv``: the frontend's adapter around ``dynamod.daemon.router.KvRouter``.

One ``KvRouter`` per base model (its block size comes from the model card); the model's LoRA
adapters share it and pass their adapter name, which changes the block hashes exactly as the
workers' KV events do. What is frontend-specific lives here: which models share a router, and
following the model registry's workers (a worker serving a base model and its adapters counts
once). Feeding the routers (KV events, load, ``kv_dump`` resyncs, replica sync on
``namespace/frontend/active_sequences_events``) is ``dynamod.daemon.router.core.feed.KvFeed``, shared
with the standalone router role.

Every decision is offered to the ``router_decisions`` publisher (console) and returned on the
``RouteChoice`` (``explain``), where the endpoint finds it for ``x-dynamo-route-explain``.

Disaggregated models get a second router per base model over the prefill pool, fed by the prefill
workers' own KV events like the decode one and, as Dynamo's prefill router, without active-block
tracking (nothing to free; a prefill worker's load is what it reports). The decode stage of a
remotely prefilled request is routed with the disaggregation policy's ``decode_overlap_weight``;
that of a prompt the policy keeps local by the predicted time of its prefill on each decode worker
(``local_prefill_choice``, daemon/router/core/local_choice.py).

A request of a session comes with ``pinned``, its session's worker (``session_routing.py``): the
KV router picks it, reason ``session``, unless it is busy, and still explains every candidate's cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dynamod.daemon.frontend.pipeline.routing import DecodeEstimate, RouteChoice, RouteRequest
from dynamod.daemon.frontend.pipeline.worker_health import FRONTEND_COMPONENT
from dynamod.daemon.router.core import KvRouter, KvRouterConfig, config_from_args
from dynamod.daemon.router.core.config import prefill_router_config
from dynamod.daemon.router.core.decision_publisher import DecisionPublisher, sample_rate_from_args
from dynamod.daemon.router.core.disagg_policy import disagg_config_from_args
from dynamod.daemon.router.core.feed import KvFeed
from dynamod.daemon.router.core.local_choice import LocalPrefillChoice
from dynamod.daemon.router.core.worker_load import decode_load, prefill_queue_tokens
from dynamod.shared.errors import DynamoError, NoInstancesError, OverloadedError
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.routing import (
    DISAGG_LOCAL,
    DISAGG_REMOTE,
    STAGE_AGG,
    STAGE_PREFILL,
    RoutingDecision,
)

if TYPE_CHECKING:
    from dynamod.daemon.frontend.pipeline.models import EndpointPool, ModelRegistry, PrefillPool, ServedModel
    from dynamod.daemon.frontend.pipeline.worker_health import RoutingSync
    from dynamod.shared.protocol.model_card import ModelCard
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

PREFILL_KEY_PREFIX = "prefill:"  # the prefill routers' feed keys, apart from the base models'


def _choice(decision: RoutingDecision, candidates: Sequence[Instance], stage: str) -> RouteChoice:
    for inst in candidates:
        if inst.instance_id == decision.worker_id:
            return RouteChoice(
                inst, dp_rank=decision.dp_rank, overlap_blocks=decision.overlap_blocks, stage=stage, explain=decision
            )
    raise DynamoError(f"kv router chose worker {decision.worker_id:x}, which is not a candidate")


def mm_prompt_hashes(kv: KvRouter, request: RouteRequest, lora_name: str | None) -> tuple[list[int], list[int]] | None:
    """The prompt's block hashes with its images' content keys, as the workers hash it (None for a
    text-only prompt: the router hashes those itself, on its fast path)."""
    if not request.mm_items:
        return None
    return hash_tokens(request.token_ids, kv.block_size, lora_name, request.mm_items)


def decode_estimate(kv: KvRouter, decision: RoutingDecision, isl: int) -> DecodeEstimate:
    """What the disaggregation policy needs of the decode worker ``decision`` names."""
    load = decode_load(kv, decision, isl)
    return DecodeEstimate(
        decision.worker_id, load.cached_tokens, load.kv_fraction, load.queued_tokens, load.running, load.transfer_ms_p50,
    )


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

    def candidate_keys(self, candidates: Sequence[Instance]) -> list[tuple[int, int]]:
        """The (worker, rank) keys of ``candidates``, the router's worker list brought to them."""
        keys = self.keys_for(candidates)
        self.ensure(keys)
        return keys


class KvModelRouter:
    """The ``Router`` of one served model (a base model or one of its LoRA adapters)."""

    name = "kv"

    def __init__(
        self, group: KvGroup, lora_name: str | None, model: str, decisions: DecisionPublisher,
        local_prefill: LocalPrefillChoice | None = None,
    ) -> None:
        self._group = group
        self._lora = lora_name
        self._model = model
        self._decisions = decisions
        self._local_prefill = local_prefill  # the decode stage of a prompt prefilled locally

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        keys = self._group.candidate_keys(candidates)
        disagg = request.disagg
        # While every worker is busy the request waits in the router's bounded queue
        # (--router-queue-size, --router-queue-timeout-secs), then gets a 503.
        decision = await self._group.kv.select_worker_waiting(
            request.request_id, request.token_ids, lora_name=self._lora, allowed=keys, overlap_weight=request.overlap_weight,
            priority=request.priority, pinned=request.pinned, prompt_hashes=mm_prompt_hashes(self._group.kv, request, self._lora),
            # Prefilled remotely: the KV is fetched (streamed while the prefill runs, with the
            # transfer overlapped); its blocks count as decode load from its first token on.
            kv_arriving=disagg is not None and disagg.mode == DISAGG_REMOTE,
            local_prefill=self._local_prefill if disagg is not None and disagg.mode == DISAGG_LOCAL else None,
        )
        if request.stage != STAGE_AGG:
            decision.stage = request.stage
            decision.disagg = request.disagg
        pin = request.prefix_pin
        if pin is not None and request.stage != STAGE_PREFILL:
            self._group.kv.credit_pin(
                (decision.worker_id, decision.dp_rank), request.token_ids, pin.num_tokens, pin.ttl_s, self._lora
            )
        self._decisions.offer(decision, self._model)
        return _choice(decision, candidates, request.stage)

    def estimate(self, request: RouteRequest, candidates: Sequence[Instance]) -> DecodeEstimate | None:
        """The worker normal KV routing would pick and the prompt prefix it caches; counts nothing."""
        keys = self._group.candidate_keys(candidates)
        kv = self._group.kv
        try:
            decision = kv.best_worker(
                request.request_id, request.token_ids, lora_name=self._lora, allowed=keys, pinned=request.pinned,
                prompt_hashes=mm_prompt_hashes(kv, request, self._lora),
            )
        except (OverloadedError, NoInstancesError):
            return None  # every decode worker busy: select will queue; the policy sees no cache
        return decode_estimate(kv, decision, len(request.token_ids))

    def record(self, choice: RouteChoice, model: str) -> None:
        return None  # select publishes its decisions

    def on_first_token(self, request_id: str) -> None:
        self._group.kv.mark_prefill_done(request_id)

    def on_finish(self, request_id: str) -> None:
        self._group.kv.free(request_id)


class KvPrefillRouter:
    """The ``Router`` of one model's prefill pool: KV-aware and queue-aware.

    ``select`` counts the prompt's uncached tokens as prefill work queued on the worker it picks
    until ``on_finish`` (the prefill stage calls it when the attempt ends or the pick is not
    used), so the next pick weighs the queue as well as the cache: Dynamo's prefill router counts
    nothing and piles a burst of long prompts on the worker with the best prefix. It does not
    publish: the pick becomes a decision only when the prompt is really sent there, which the
    prefill stage reports through ``record``."""

    name = "kv"

    def __init__(self, group: KvGroup, lora_name: str | None, decisions: DecisionPublisher) -> None:
        self._group = group
        self._lora = lora_name
        self._decisions = decisions

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        keys = self._group.candidate_keys(candidates)
        kv = self._group.kv
        decision = kv.select_worker(
            request.request_id, request.token_ids, lora_name=self._lora, allowed=keys,
            prompt_hashes=mm_prompt_hashes(kv, request, self._lora),
        )
        decision.stage = STAGE_PREFILL
        choice = _choice(decision, candidates, STAGE_PREFILL)
        choice.load = float(prefill_queue_tokens(kv, decision))
        return choice

    def estimate(self, request: RouteRequest, candidates: Sequence[Instance]) -> DecodeEstimate | None:
        """The prefill worker ``select`` would pick and the prompt prefix it caches; counts nothing
        (the encode stage skips images that worker caches)."""
        kv = self._group.kv
        try:
            decision = kv.best_worker(
                request.request_id, request.token_ids, lora_name=self._lora, allowed=self._group.candidate_keys(candidates),
                prompt_hashes=mm_prompt_hashes(kv, request, self._lora),
            )
        except (OverloadedError, NoInstancesError):
            return None
        return decode_estimate(kv, decision, len(request.token_ids))

    def record(self, choice: RouteChoice, model: str) -> None:
        if choice.explain is not None:
            self._decisions.offer(choice.explain, model)

    def on_first_token(self, request_id: str) -> None:
        return None

    def on_finish(self, request_id: str) -> None:
        self._group.kv.free(request_id)


class KvRouting:
    """Owns the KV routers of this frontend; ``KvFeed`` feeds them."""

    def __init__(self, args: argparse.Namespace, runtime: DistributedRuntime, sync: RoutingSync) -> None:
        config: KvRouterConfig = config_from_args(args)
        replicas = (
            getattr(args, "num_frontends", 1) > 1
            or getattr(args, "frontend_group_pid", None) is not None
            or getattr(args, "reuse_port", False)
        )
        if replicas and not config.router_replica_sync:
            config = dataclasses.replace(config, router_replica_sync=True)
        self.config = config
        self._rt = runtime
        self.groups: dict[str, KvGroup] = {}
        self.prefill_groups: dict[str, KvGroup] = {}
        self.prefill_config = prefill_router_config(config)
        # The decode worker of a prompt the conditional policy keeps local (None: policy off).
        self.local_prefill = disagg_config_from_args(args).local_prefill_choice()
        self.feed = KvFeed(runtime, config, sync_component=FRONTEND_COMPONENT)
        self.decisions = DecisionPublisher(runtime, FRONTEND_COMPONENT, sample_rate=sample_rate_from_args(args))

    # -- lifecycle --------------------------------------------------------------------------

    def attach(self, registry: ModelRegistry) -> None:
        registry.worker_listeners.append(self._on_worker)
        registry.prefill_listeners.append(self._on_prefill_worker)

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
        group = self._group(self.groups, self.config, model.card, model.name, "")
        return KvModelRouter(group, model.card.lora, model.name, self.decisions, self.local_prefill)

    def prefill_router_for(self, pool: PrefillPool) -> KvPrefillRouter:
        group = self._group(self.prefill_groups, self.prefill_config, pool.card, pool.name, PREFILL_KEY_PREFIX)
        return KvPrefillRouter(group, pool.card.lora, self.decisions)

    def _group(
        self, groups: dict[str, KvGroup], config: KvRouterConfig, card: ModelCard, name: str, feed_prefix: str
    ) -> KvGroup:
        """The KV router of ``card``'s base model in ``groups`` (decode or prefill), made on first use."""
        base = card.base_model or name
        group = groups.get(base)
        if group is None:
            if card.kv_block_size <= 0:
                raise DynamoError(f"model {name!r} publishes no kv_block_size; the kv router needs it")
            kv = KvRouter(config, card.kv_block_size, registry=self._rt.registry, on_resync=self.feed.request_resync)
            group = KvGroup(base, kv, card.runtime_config.data_parallel_size)
            groups[base] = group
            self.feed.add_router(feed_prefix + base, kv)
        return group

    def _worker_joined(self, group: KvGroup, card: ModelCard, pools: dict[int, EndpointPool], worker_id: int) -> None:
        """A worker new to ``group``: its KV capacity per rank (from ``card``) and its KV events
        (through the endpoint pool ``pools`` has for it, if any)."""
        total = card.runtime_config.total_kv_blocks
        if total:
            for rank in range(group.dp_size):
                group.kv.set_worker_capacity((worker_id, rank), total)
        pool = pools.get(worker_id)
        if pool is not None:
            self.feed.add_worker(group.kv, worker_id, pool.component)

    def _on_prefill_worker(self, pool: PrefillPool, worker_id: int, added: bool) -> None:
        group = self.prefill_groups.get(pool.card.base_model or pool.name)
        if group is None:
            return
        if added:
            self._worker_joined(group, pool.card, pool.workers, worker_id)
            return
        self.feed.remove_worker(group.kv, worker_id)

    def _on_worker(self, model: ServedModel, worker_id: int, added: bool) -> None:
        group = self.groups.get(model.card.base_model or model.name)
        if group is None:
            return
        if added:
            group.workers[worker_id] = group.workers.get(worker_id, 0) + 1
            if group.workers[worker_id] > 1:
                return
            self._worker_joined(group, model.card, model.workers, worker_id)
            return
        left = group.workers.get(worker_id, 0) - 1
        if left > 0:
            group.workers[worker_id] = left
            return
        group.workers.pop(worker_id, None)
        self.feed.remove_worker(group.kv, worker_id)
