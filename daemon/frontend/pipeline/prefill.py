"""The frontend's prefill pool as the shared prefill stage (``daemon/router/core/prefill_stage``) sees it.

Picks among the model's ready, unquarantined prefill workers with the pool's router (KV-aware in
kv mode, else round-robin/random), reaches them through the pool's endpoint clients, counts the
prompt tokens in flight per prefill worker (the ``prefill_load`` policy's load when the worker's
own metrics are not at hand), publishes the prefill decision once the prompt is really sent there,
and quarantines a prefill worker whose stream broke, as the decode path does. The pool's router
counts a picked prompt as queued prefill work until ``done`` or ``discard`` (kv mode: the next
pick weighs it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from dynamod.daemon.frontend.pipeline.models import EndpointPool, PrefillPool
from dynamod.daemon.frontend.pipeline.routing import Quarantine, RouteChoice, RouteRequest
from dynamod.daemon.router.core.prefill_stage import PrefillPick
from dynamod.shared.errors import TransportError
from dynamod.shared.protocol.llm import PreprocessedRequest
from dynamod.shared.protocol.routing import STAGE_PREFILL


class FrontendPrefillTarget:
    """One request's view of its model's prefill pool (built only for disaggregated models)."""

    __slots__ = ("_pool", "_model", "_quarantine", "_report_dead")

    def __init__(self, pool: PrefillPool, model: str, quarantine: Quarantine, report_dead: Callable[[int], None]) -> None:
        self._pool = pool
        self._model = model
        self._quarantine = quarantine
        self._report_dead = report_dead

    async def pick(self, request: PreprocessedRequest, exclude: set[int]) -> PrefillPick | None:
        pool = self._pool
        candidates = pool.candidates(self._quarantine, exclude)
        if not candidates or pool.router is None:
            return None
        choice = await pool.router.select(
            RouteRequest(request.request_id, request.token_ids, request.lora_name, stage=STAGE_PREFILL,
                         mm_items=request.mm_items), candidates
        )
        wid = choice.worker_id
        endpoint_pool = pool.workers.get(wid)
        if endpoint_pool is None:
            pool.router.on_finish(request.request_id)  # it left meanwhile: nothing waits there
            return None
        own = float(pool.inflight_tokens.get(wid, 0))
        load = own if choice.load is None else max(choice.load, own)
        cached = min(choice.overlap_blocks * max(pool.card.kv_block_size, 0), len(request.token_ids))
        return PrefillPick(
            wid, choice.dp_rank, (choice, endpoint_pool), overlap_blocks=choice.overlap_blocks, load=load, cached_tokens=cached
        )

    def open(self, pick: PrefillPick, body: PreprocessedRequest) -> AsyncIterator[Any]:
        choice, endpoint_pool = _handle(pick)
        return endpoint_pool.client.stream_to(choice.instance, body, request_id=body.request_id)

    def sent(self, pick: PrefillPick, body: PreprocessedRequest) -> None:
        inflight = self._pool.inflight_tokens
        inflight[pick.worker_id] = inflight.get(pick.worker_id, 0) + len(body.token_ids)
        router = self._pool.router
        if router is not None:
            router.record(_handle(pick)[0], self._model)

    def done(self, pick: PrefillPick, body: PreprocessedRequest, error: Exception | None) -> None:
        inflight = self._pool.inflight_tokens
        left = inflight.get(pick.worker_id, 0) - len(body.token_ids)
        if left > 0:
            inflight[pick.worker_id] = left
        else:
            inflight.pop(pick.worker_id, None)
        router = self._pool.router
        if router is not None:
            router.on_finish(body.request_id)  # the kv prefill router counted it as queued work
        if isinstance(error, TransportError):
            self._report_dead(pick.worker_id)

    def discard(self, pick: PrefillPick, request: PreprocessedRequest) -> None:
        router = self._pool.router
        if router is not None:
            router.on_finish(request.request_id)


def prefill_route(pick: PrefillPick) -> RouteChoice:
    """The routing choice behind a pick (for the request object and the explain header)."""
    return _handle(pick)[0]


def _handle(pick: PrefillPick) -> tuple[RouteChoice, EndpointPool]:
    return pick.handle  # type: ignore[no-any-return]
