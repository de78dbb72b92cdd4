"""Sends a preprocessed request to a worker and keeps its token stream going across failures.

``EngineStream`` yields the worker's ``EngineOutput`` frames (plain dicts, as the request plane
decodes them: no per-token conversion). When the stream breaks (``TransportError``: the worker
died or its connection dropped; ``UnavailableError`` or an ``abort`` finish the client did not ask
for: the worker is draining or went to sleep) the request is re-sent to another worker with the
tokens generated so far appended to the prompt and ``max_tokens`` reduced by as many, up to the
migration limit. The caller sees one stream: no token twice, none missing.

A request that finds no ready worker waits up to ``worker_wait_s`` for one to appear (a worker
restarting, the first worker still loading) before giving up with a 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from dynamod.daemon.frontend.models import EndpointPool, ModelRegistry, ServedModel
from dynamod.daemon.frontend.routing import Quarantine, RouteChoice, RouteRequest
from dynamod.shared.errors import NoInstancesError, TransportError, UnavailableError
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.llm import FINISH_ABORT, FINISH_LENGTH, PreprocessedRequest

logger = logging.getLogger(__name__)

_MIGRATABLE = (TransportError, UnavailableError)
DEFAULT_MIGRATION_LIMIT = 3


class WorkerAborted(UnavailableError):
    """The worker ended the request with ``abort`` although the client is still there."""


class Dispatcher:
    """Shared by all requests: the registry, the quarantine and the migration policy."""

    def __init__(
        self,
        registry: ModelRegistry,
        quarantine: Quarantine,
        *,
        migration_limit: int,
        worker_wait_s: float,
    ) -> None:
        self.registry = registry
        self.quarantine = quarantine
        self.migration_limit = migration_limit
        self.worker_wait_s = worker_wait_s
        # Told when this process finds a worker unreachable (other frontends quarantine it too).
        self.on_worker_down: Callable[[int], None] | None = None

    def open(
        self,
        model: ServedModel,
        request: PreprocessedRequest,
        *,
        direct_ids: list[int] | None = None,
        migration_limit: int | None = None,
    ) -> EngineStream:
        # The frontend's --migration-limit, when given, overrides the model card's.
        if self.migration_limit >= 0:
            limit = self.migration_limit
        else:
            limit = migration_limit if migration_limit is not None else DEFAULT_MIGRATION_LIMIT
        return EngineStream(self, model, request, direct_ids=direct_ids, migration_limit=limit)

    def report_dead(self, worker_id: int) -> None:
        if worker_id in self.quarantine:
            return
        self.quarantine.add(worker_id)
        logger.warning("worker unreachable worker_id=%x action=quarantined hold_s=%.1f", worker_id, self.quarantine.hold_s)
        if self.on_worker_down is not None:
            self.on_worker_down(worker_id)


class EngineStream:
    """One request's engine output across migrations; iterate with ``async for``, end with ``aclose``."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        model: ServedModel,
        request: PreprocessedRequest,
        *,
        direct_ids: list[int] | None,
        migration_limit: int,
    ) -> None:
        self._d = dispatcher
        self.model = model
        self.request = request
        self.prompt_len = len(request.token_ids)
        self.max_tokens = request.stop.max_tokens
        self.generated: list[int] = []
        self.migrations = 0
        self.migration_limit = migration_limit
        self.worker_id: int | None = None
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._direct_ids = direct_ids
        self._gen = self._run()

    def __aiter__(self) -> EngineStream:
        return self

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    # -- routing ----------------------------------------------------------------------------

    async def _choose(self, exclude: set[int]) -> tuple[RouteChoice, EndpointPool]:
        model = self.model
        if self._direct_ids is not None:
            for wid in self._direct_ids:
                found = model.live_instance(wid)
                if found is not None:
                    return RouteChoice(found[0]), found[1]
            shown = ", ".join(f"{w:x}" for w in self._direct_ids)
            raise NoInstancesError(f"no live worker {shown} serves model {model.name!r} (x-dynamo-worker-instance-id)")
        deadline = time.monotonic() + self._d.worker_wait_s
        quarantine = self._d.quarantine
        while True:
            candidates = model.candidates(quarantine, exclude)
            if candidates:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                # Quarantined workers may have recovered (a connection blip): better than a 503.
                candidates = model.candidates(Quarantine(0), exclude)
                if candidates:
                    break
                raise NoInstancesError(
                    f"no ready worker serves model {model.name!r} (waited {self._d.worker_wait_s:.1f}s)"
                )
            await self._d.registry.wait_changed(left)
            # The model may have been replaced (all workers gone, then back): follow the name.
            current = self._d.registry.models.get(model.name)
            if current is not None and current is not model:
                self.model = model = current
        router = model.router
        assert router is not None
        choice = await router.select(RouteRequest(self.request.request_id, self.request.token_ids, model.lora_name), candidates)
        pool = model.workers[choice.worker_id]
        return choice, pool

    def _attempt_body(self, choice: RouteChoice) -> PreprocessedRequest:
        """The request for this attempt; the request plane encodes the struct as msgpack directly."""
        request = self.request
        if choice.dp_rank is not None or choice.overlap_blocks:
            request = msgspec.structs.replace(
                request, dp_rank=choice.dp_rank, estimated_prefix_hit_blocks=choice.overlap_blocks or None
            )
        if not self.generated:
            return request
        stop = msgspec.structs.replace(
            request.stop,
            max_tokens=None if self.max_tokens is None else self.max_tokens - len(self.generated),
            min_tokens=None if request.stop.min_tokens is None else max(0, request.stop.min_tokens - len(self.generated)),
        )
        return msgspec.structs.replace(request, token_ids=request.token_ids + self.generated, stop=stop)

    # -- the stream -------------------------------------------------------------------------

    async def _run(self) -> AsyncIterator[dict[str, Any]]:
        exclude: set[int] = set()
        request_id = self.request.request_id
        generated = self.generated
        model_metrics = self.model.metrics
        while True:
            choice, pool = await self._choose(exclude)
            instance: Instance = choice.instance
            worker_id = instance.instance_id
            self.worker_id = worker_id
            router = self.model.router
            assert router is not None
            stream = pool.client.stream_to(instance, self._attempt_body(choice), request_id=request_id)
            first = True
            try:
                async for out in stream:
                    tokens = out.get("token_ids")
                    finish = out.get("finish_reason")
                    if tokens:
                        if first:
                            first = False
                            router.on_first_token(request_id)
                        generated.extend(tokens)
                    usage = out.get("usage")
                    if usage:
                        self.cached_tokens = min(int(usage.get("cached_tokens") or 0), self.prompt_len)
                    if finish == FINISH_ABORT:
                        if tokens:
                            yield {"token_ids": tokens, "log_probs": out.get("log_probs")}
                        raise WorkerAborted(f"worker {worker_id:x} aborted the request")
                    if finish is not None:
                        self.finish_reason = finish
                    yield out
                    if finish is not None:
                        return
                raise TransportError(f"worker {worker_id:x} ended the stream without a finish reason")
            except _MIGRATABLE as exc:
                if isinstance(exc, TransportError):
                    self._d.report_dead(worker_id)
                exclude.add(worker_id)
                if self._direct_ids is not None or self.migrations >= self.migration_limit:
                    logger.warning(
                        "request failed without migration request_id=%s worker_id=%x migrations=%d error=%s",
                        request_id, worker_id, self.migrations, exc,
                    )
                    raise
                self.migrations += 1
                (model_metrics.migrate_ongoing if generated else model_metrics.migrate_new).inc()
                logger.info(
                    "request migrating request_id=%s from_worker=%x generated=%d attempt=%d error=%s",
                    request_id, worker_id, len(generated), self.migrations, exc,
                )
                if self.max_tokens is not None and len(generated) >= self.max_tokens:
                    self.finish_reason = FINISH_LENGTH
                    yield {"token_ids": [], "finish_reason": FINISH_LENGTH}
                    return
            finally:
                router.on_finish(request_id)
                await stream.aclose()
