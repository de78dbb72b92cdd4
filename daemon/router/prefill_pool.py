"""The standalone router's prefill pool: the workers of the prefill component, KV-routed.

The router role (``dynamod --role router``) follows the ready ``generate`` instances of the prefill
component and their model cards (block size, data-parallel size) as it does the decode workers,
with a ``KvRouter`` of its own fed by the prefill workers' KV events through the same ``KvFeed``.
Unlike Dynamo's prefill router it counts each picked prompt's uncached tokens as queued prefill
work on its worker until the attempt ends or the pick is discarded, so picks weigh the queue as
well as the prefix cache (``scheduler.py``'s cost). It skips no busy worker: what a busy prefill
worker means is the policy's call, from its queue (``worker_load.prefill_queue_tokens``: the
worker's report or the router's count, the larger). It is the ``PrefillTarget`` the shared
``PrefillStage`` drives.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from dynamod.daemon.router.core.config import KvRouterConfig, prefill_router_config
from dynamod.daemon.router.core.decision_publisher import DecisionPublisher
from dynamod.daemon.router.core.feed import KvFeed
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.daemon.router.core.prefill_stage import PrefillPick
from dynamod.daemon.router.core.worker_load import prefill_queue_tokens
from dynamod.shared.errors import NoInstancesError
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import parse_key
from dynamod.shared.protocol.llm import PreprocessedRequest
from dynamod.shared.protocol.model_card import ModelCard
from dynamod.shared.protocol.routing import STAGE_PREFILL, RoutingDecision

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

GENERATE = "generate"


class RouterPrefillPool:
    def __init__(
        self,
        runtime: DistributedRuntime,
        kv_config: KvRouterConfig,
        feed: KvFeed,
        decisions: DecisionPublisher,
        component: str,
    ) -> None:
        self._rt = runtime
        self.component = component
        self.kv_config = prefill_router_config(kv_config)
        self._feed = feed
        self._decisions = decisions
        self.kv: KvRouter | None = None
        self.client: EndpointClient | None = None
        self._cards: dict[int, ModelCard] = {}
        self._dp_size: dict[int, int] = {}
        self.seen = False  # a prefill card was seen once: the decode workers are served disaggregated

    async def start(self) -> None:
        self.client = await self._rt.namespace().component(self.component).endpoint(GENERATE).client()
        self.client.instance_set.add_listener(self._on_instance)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    # -- workers (cards come from the service's ModelCardSet, decoded) ----------------------------

    def card_put(self, wid: int, lora: str | None, card: ModelCard) -> None:
        if lora is not None:
            return
        if self.kv is None:
            self.kv = KvRouter(self.kv_config, card.kv_block_size, registry=self._rt.registry, on_resync=self._feed.request_resync)
            self._feed.add_router(f"prefill:{self.component}", self.kv)
        elif card.kv_block_size != self.kv.block_size:
            logger.warning("router ignores prefill worker with another block size worker_id=%016x block_size=%d", wid, card.kv_block_size)
            return
        self.seen = True
        self._cards[wid] = card
        self._reconcile(wid)

    def card_deleted(self, wid: int, lora: str | None) -> None:
        if lora is None:
            self._cards.pop(wid, None)
            self._reconcile(wid)

    def _on_instance(self, key: str, inst: Instance | None) -> None:
        parsed = parse_key(key)
        if parsed is not None:
            self._reconcile(parsed.instance_id)

    def _reconcile(self, wid: int) -> None:
        card = self._cards.get(wid)
        present = card is not None and self.client is not None and self.client.instance_set.get(wid) is not None
        kv = self.kv
        if present and wid not in self._dp_size and kv is not None and card is not None:
            dp = max(1, card.runtime_config.data_parallel_size)
            self._dp_size[wid] = dp
            self._feed.add_worker(kv, wid, self.component)
            logger.info("router prefill worker added worker_id=%016x dp_size=%d", wid, dp)
        elif not present and wid in self._dp_size:
            del self._dp_size[wid]
            if kv is not None:
                self._feed.remove_worker(kv, wid)
            logger.info("router prefill worker left worker_id=%016x", wid)
        if kv is not None:
            kv.update_workers(self.routable())

    def routable(self, exclude: set[int] | frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        keys: list[tuple[int, int]] = []
        if self.client is not None:
            for inst in self.client.routable:
                dp = self._dp_size.get(inst.instance_id)
                if dp is not None and inst.instance_id not in exclude:
                    keys.extend((inst.instance_id, rank) for rank in range(dp))
        return keys

    def best(self, request_id: str, token_ids: list[int], lora_name: str | None) -> RoutingDecision:
        """``best_worker_id`` for the prefill stage."""
        if self.kv is None or not self.kv.workers:
            raise NoInstancesError(f"no ready prefill worker of component {self.component!r}")
        decision = self.kv.best_worker(request_id, token_ids, lora_name=lora_name)
        decision.stage = STAGE_PREFILL
        return decision

    # -- PrefillTarget ------------------------------------------------------------------------------

    async def pick(self, request: PreprocessedRequest, exclude: set[int]) -> PrefillPick | None:
        kv = self.kv
        keys = self.routable(exclude)
        if kv is None or not keys or self.client is None:
            return None
        decision = kv.select_worker(request.request_id, request.token_ids, lora_name=request.lora_name, allowed=keys)
        decision.stage = STAGE_PREFILL
        inst = self.client.instance_set.get(decision.worker_id)
        if inst is None:
            kv.free(request.request_id)
            return None
        load = float(prefill_queue_tokens(kv, decision))
        cached = min(decision.overlap_blocks * kv.block_size, len(request.token_ids))
        return PrefillPick(
            decision.worker_id, decision.dp_rank, (inst, decision), overlap_blocks=decision.overlap_blocks, load=load,
            cached_tokens=cached,
        )

    def open(self, pick: PrefillPick, body: PreprocessedRequest) -> AsyncIterator[Any]:
        assert self.client is not None
        inst, _ = pick.handle
        return self.client.stream_to(inst, body, request_id=body.request_id)

    def sent(self, pick: PrefillPick, body: PreprocessedRequest) -> None:
        self._decisions.offer(pick.handle[1], body.model)

    def done(self, pick: PrefillPick, body: PreprocessedRequest, error: Exception | None) -> None:
        # The prompt no longer waits there. A dead prefill worker leaves discovery within one
        # lease TTL; one retry covers the gap.
        if self.kv is not None:
            self.kv.free(body.request_id)

    def discard(self, pick: PrefillPick, request: PreprocessedRequest) -> None:
        if self.kv is not None:
            self.kv.free(request.request_id)
