"""Sends a preprocessed request to a worker and keeps its token stream going across failures.

``EngineStream`` yields the worker's ``EngineOutput`` frames (plain dicts, as the request plane
decodes them: no per-token conversion). When the stream breaks (``TransportError``: the worker
died, its connection dropped, it went silent for the request plane's heartbeat timeout (frozen or
hung) or it left discovery; ``UnavailableError`` or an ``abort`` finish the client did not ask
for: the worker is draining or went to sleep) the request is re-sent to another worker with the
tokens generated so far appended to the prompt and ``max_tokens`` reduced by as many, up to the
migration limit. The caller sees one stream: no token twice, none missing.

A disaggregated model (one with a prefill pool) puts the prefill stage before each attempt: the
shared ``PrefillStage`` decides remote or local and, when remote, gets the transfer parameters
from a prefill worker, which ride on the decode request; the decode worker is then routed with the
policy's overlap weight for remote prompts (``decode_overlap_weight``: its cached prefix is what
the transfer does not move). A migration prefills again through the same policy,
with the generated tokens in the prompt. The first token of a request's first attempt goes back to
the stage (``first_token``), which learns what each path costs beyond its prediction. An
aggregated model pays one attribute test for this.

Everything the request learns on the way (routes and their explanations, where it was prefilled,
tokens, migrations) goes into its ``EngineRequest``, which the response writers read back.

A request that finds no ready worker waits up to ``worker_wait_s`` for one to appear (a worker
restarting, the first worker still loading) before giving up with a 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from dynamod.daemon.frontend.pipeline.encode import EncodeStage
from dynamod.daemon.frontend.pipeline.models import EndpointPool, ModelRegistry, ServedModel
from dynamod.daemon.frontend.pipeline.prefill import FrontendPrefillTarget, prefill_route
from dynamod.daemon.frontend.pipeline.request import EngineRequest
from dynamod.daemon.frontend.pipeline.routing import Quarantine, RouteChoice, RouteRequest
from dynamod.daemon.frontend.pipeline.tracing import (
    migration_span,
    ms_between_ns,
    note_worker,
    route_span,
)
from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from dynamod.daemon.router.core.prefill_stage import DecodeHint, PrefillOutcome, PrefillStage, close_drains
from dynamod.shared.errors import NoInstancesError, TransportError, UnavailableError
from dynamod.shared.observability import tracing
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.llm import FINISH_ABORT, FINISH_LENGTH, PreprocessedRequest
from dynamod.shared.protocol.routing import STAGE_DECODE, STAGE_PREFILL
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.client import InstanceGoneError

logger = logging.getLogger(__name__)

_MIGRATABLE = (TransportError, UnavailableError)
DEFAULT_MIGRATION_LIMIT = 3


class WorkerAborted(UnavailableError):
    """The worker ended the request with ``abort`` although the client is still there."""


class Dispatcher:
    """Shared by all requests: the registry, the quarantine, the migration policy and the
    prefill stage of disaggregated models."""

    def __init__(
        self,
        registry: ModelRegistry,
        quarantine: Quarantine,
        *,
        migration_limit: int,
        worker_wait_s: float,
        prefill_stage: PrefillStage | None = None,
    ) -> None:
        self.registry = registry
        self.quarantine = quarantine
        self.migration_limit = migration_limit
        self.worker_wait_s = worker_wait_s
        self.prefill_stage = prefill_stage or PrefillStage(DisaggPolicyConfig(), registry.metrics.disagg)
        # Told when this process finds a worker unreachable (other frontends quarantine it too).
        self.on_worker_down: Callable[[int], None] | None = None
        # Sends images to the model's encode pool (pipeline/encode.py); None: workers encode them.
        self.encode_stage: EncodeStage | None = None

    def open(self, request: EngineRequest) -> EngineStream:
        # The frontend's --migration-limit, when given, overrides the model card's.
        if self.migration_limit >= 0:
            request.migration_limit = self.migration_limit
        return EngineStream(self, request)

    def report_dead(self, worker_id: int) -> None:
        if worker_id in self.quarantine:
            return
        self.quarantine.add(worker_id)
        logger.warning("worker unreachable worker_id=%016x action=quarantined hold_s=%.1f", worker_id, self.quarantine.hold_s)
        if self.on_worker_down is not None:
            self.on_worker_down(worker_id)


class EngineStream:
    """One request's engine output across migrations; iterate with ``async for``, end with ``aclose``."""

    def __init__(self, dispatcher: Dispatcher, request: EngineRequest) -> None:
        self._d = dispatcher
        self.request = request
        self.max_tokens = request.preprocessed.stop.max_tokens
        self._stream: Any = None  # the current attempt's request-plane stream
        self._gen = self._run()

    # The generation layer's view (TextGeneration reads these on every delta).
    @property
    def generated(self) -> list[int]:
        return self.request.generated

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def cached_tokens(self) -> int:
        return self.request.cached_tokens

    @property
    def buffered(self) -> int:
        """Frames received from the worker and not read yet: the next read will not wait."""
        stream = self._stream
        return getattr(stream, "buffered", 0) if stream is not None else 0

    def __aiter__(self) -> EngineStream:
        return self

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            if self.request.prefill_drains:
                await close_drains(self.request.prefill_drains)

    # -- routing ----------------------------------------------------------------------------

    def _direct(self) -> tuple[RouteChoice, EndpointPool]:
        req = self.request
        assert req.direct_ids is not None
        for wid in req.direct_ids:
            found = req.model.live_instance(wid)
            if found is not None:
                return RouteChoice(found[0]), found[1]
        shown = ", ".join(worker_id_hex(w) for w in req.direct_ids)
        raise NoInstancesError(f"no live worker {shown} serves model {req.model.name!r} (x-dynamo-worker-instance-id)")

    async def _candidates(self, exclude: set[int]) -> list[Instance]:
        """Ready workers of the model, waiting up to ``worker_wait_s`` for one."""
        req = self.request
        model = req.model
        deadline = time.monotonic() + self._d.worker_wait_s
        quarantine = self._d.quarantine
        while True:
            candidates = model.candidates(quarantine, exclude)
            if candidates:
                return candidates
            left = deadline - time.monotonic()
            if left <= 0:
                # Quarantined workers may have recovered (a connection blip): better than a 503.
                candidates = model.candidates(Quarantine(0), exclude)
                if candidates:
                    return candidates
                raise NoInstancesError(
                    f"no ready worker serves model {model.name!r} (waited {self._d.worker_wait_s:.1f}s)"
                )
            await self._d.registry.wait_changed(left)
            # The model may have been replaced (all workers gone, then back): follow the name.
            current = self._d.registry.models.get(model.name)
            if current is not None and current is not model:
                req.model = model = current

    async def _choose(self, exclude: set[int]) -> tuple[RouteChoice, EndpointPool, PrefillOutcome | None]:
        req = self.request
        if req.direct_ids is not None:
            choice, pool = self._direct()
            await self._encode(choice.overlap_blocks * req.model.card.kv_block_size if req.model.prefill is None else 0)
            outcome = await self._prefill([choice.instance]) if req.model.prefill is not None else None
            return choice, pool, outcome
        candidates = await self._candidates(exclude)
        pre = req.preprocessed
        outcome: PrefillOutcome | None = None
        if req.model.prefill is not None:
            if pre.mm_items and self._d.encode_stage is not None:  # a text prompt skips the estimate
                await self._encode(self._prefill_cached_tokens())  # the prefill stage picks the worker
            outcome = await self._prefill(candidates)
            candidates = await self._candidates(exclude)  # the prefill took a while: who is still here
        passed: set[int] = set()
        while True:
            model = req.model
            router = model.router
            assert router is not None
            if outcome is None:
                route = RouteRequest(
                    req.request_id, pre.token_ids, model.lora_name, priority=pre.priority, session=req.session,
                    mm_items=pre.mm_items, prefix_pin=pre.pin,
                )
            else:
                # Decode stage: a prompt prefilled remotely is fetched, not computed; what the
                # decode worker caches is what the transfer does not move (the policy's weight).
                route = RouteRequest(
                    req.request_id, pre.token_ids, model.lora_name, stage=STAGE_DECODE,
                    overlap_weight=self._d.prefill_stage.policy.decode_overlap_weight(outcome.remote), disagg=outcome.info,
                    priority=pre.priority, session=req.session, mm_items=pre.mm_items, prefix_pin=pre.pin,
                )
            routed_at = time.time_ns()
            choice = await router.select(route, candidates)
            route_span(req.trace, choice, routed_at, route.stage)
            pool = model.workers.get(choice.worker_id)
            if pool is not None:
                if outcome is None:  # aggregated: images whose tokens the worker caches need no encode
                    try:
                        await self._encode(choice.overlap_blocks * model.card.kv_block_size)
                    except BaseException:
                        router.on_finish(req.request_id)  # the client left while its images were encoded
                        raise
                return choice, pool, outcome
            # The worker left while the router held the request (its queue, a busy fleet): not a
            # failure of the request, and not a migration; route it again among those still here.
            router.on_finish(req.request_id)
            passed.add(choice.worker_id)
            logger.info(
                "routed worker left before dispatch request_id=%s worker_id=%016x action=reroute",
                req.request_id, choice.worker_id,
            )
            candidates = await self._candidates(exclude | passed)

    def _prefill_cached_tokens(self) -> int:
        """The prompt tokens the prefill worker the stage is likely to pick caches (its router's
        estimate; 0 without one). Should the stage pick another, or prefill on the decode worker,
        the images skipped here are encoded by that worker: slower, never wrong."""
        req = self.request
        pp = req.model.prefill
        if pp is None or pp.router is None:
            return 0
        candidates = pp.candidates(self._d.quarantine)
        if not candidates:
            return 0
        pre = req.preprocessed
        est = pp.router.estimate(
            RouteRequest(req.request_id, pre.token_ids, req.model.lora_name, stage=STAGE_PREFILL, mm_items=pre.mm_items),
            candidates,
        )
        return 0 if est is None else est.cached_tokens

    async def _encode(self, cached_tokens: int) -> None:
        """The encode stage, for a prefilling worker that caches ``cached_tokens`` of the prompt."""
        stage = self._d.encode_stage
        req = self.request
        if stage is None or not req.preprocessed.mm_items:
            return
        if req.migrations:
            stage.forget(req)  # the first attempt's reader freed those embeddings: encode again
        span = tracing.tracer().child(req.trace, "encode", attempt=req.migrations)
        try:
            # The encode worker's span is a child of this one (or learns the request is unsampled).
            with tracing.use_span(span or req.trace):
                await stage.run(req, cached_tokens)
        finally:
            if span is not None:
                items = req.preprocessed.mm_items or []
                span.set("images", len(items))
                span.set("images_remote", sum(1 for item in items if item.embedding is not None))
                span.end()

    async def _prefill(self, candidates: list[Instance]) -> PrefillOutcome:
        """The prefill stage of this attempt (the prompt plus what was generated so far)."""
        req = self.request
        model = req.model
        assert model.prefill is not None
        body = self._prompt_request()
        target = FrontendPrefillTarget(model.prefill, model.name, self._d.quarantine, self._d.report_dead)
        span = tracing.tracer().child(req.trace, tracing.SPAN_PREFILL, attempt=req.migrations)
        started_ns = time.time_ns()
        try:
            # The prefill request carries this span's traceparent (or the unsampled root's).
            with tracing.use_span(span or req.trace):
                outcome = await self._d.prefill_stage.run(
                    body, target, lambda: self._decode_hint(model, candidates, body), model=model.name,
                    drains=req.prefill_drains,
                )
        except Exception as exc:
            if span is not None:
                span.fail(exc)
                span.end()
            raise
        if span is not None:
            info = outcome.info
            span.update({
                "remote": outcome.remote, "disagg.mode": info.mode, "disagg.reason": info.reason,
                "disagg.detail": info.detail, "disagg.policy": info.policy, "isl": info.isl,
                "effective_isl": info.effective_isl, "cached_tokens": outcome.cached_tokens,
                "failures": ",".join(outcome.failures) or None,
            })
            if outcome.pick is not None:
                span.set("worker_id", worker_id_hex(outcome.pick.worker_id))
            span.end()
        if outcome.remote and outcome.pick is not None:
            route_span(req.trace, prefill_route(outcome.pick), started_ns, "prefill")
            note_worker(req.trace, outcome.pick.worker_id)
        req.disagg = outcome.info
        req.prefill_route = prefill_route(outcome.pick) if outcome.remote and outcome.pick is not None else None
        if outcome.remote:
            req.prefill_s = outcome.duration_s
        return outcome

    def _decode_hint(self, model: ServedModel, candidates: list[Instance], body: PreprocessedRequest) -> DecodeHint:
        router = model.router
        route = RouteRequest(
            body.request_id, body.token_ids, model.lora_name, session=self.request.session, mm_items=body.mm_items
        )
        est = None if router is None else router.estimate(route, candidates)
        if est is None:
            return DecodeHint()
        transfer = self._d.prefill_stage.transfer_estimate(est.worker_id, est.transfer_ms_p50)
        return DecodeHint(est.cached_tokens, est.kv_fraction, est.worker_id, est.queued_tokens, est.running, transfer)

    def _prompt_request(self) -> PreprocessedRequest:
        """The request with the tokens generated so far appended to the prompt (a migration
        continues where the broken stream stopped) and the output budget reduced to match."""
        request = self.request.preprocessed
        generated = self.request.generated
        if not generated:
            return request
        stop = msgspec.structs.replace(
            request.stop,
            max_tokens=None if self.max_tokens is None else self.max_tokens - len(generated),
            min_tokens=None if request.stop.min_tokens is None else max(0, request.stop.min_tokens - len(generated)),
        )
        return msgspec.structs.replace(request, token_ids=request.token_ids + generated, stop=stop)

    def _attempt_body(self, choice: RouteChoice, outcome: PrefillOutcome | None) -> PreprocessedRequest:
        """The request for this attempt; the request plane encodes the struct as msgpack directly."""
        request = self._prompt_request()
        params = None if outcome is None else outcome.params
        if choice.dp_rank is not None or choice.overlap_blocks or params is not None:
            request = msgspec.structs.replace(
                request, dp_rank=choice.dp_rank, estimated_prefix_hit_blocks=choice.overlap_blocks or None,
                disaggregated_params=params,
            )
        return request

    # -- the stream -------------------------------------------------------------------------

    async def _run(self) -> AsyncIterator[dict[str, Any]]:
        req = self.request
        exclude: set[int] = set()
        request_id = req.request_id
        generated = req.generated
        prompt_len = req.prompt_len
        model_metrics = req.model.metrics
        migrating: tracing.Span | None = None  # the migration span, ended once the next worker is chosen
        while True:
            try:
                choice, pool, outcome = await self._choose(exclude)
            except Exception as exc:
                if migrating is not None:
                    migrating.fail(exc)
                    migrating.end()
                raise
            req.decode_route = choice
            instance: Instance = choice.instance
            worker_id = instance.instance_id
            if migrating is not None:
                migrating.set("to_worker_id", worker_id_hex(worker_id))
                migrating.end()
                migrating = None
            note_worker(req.trace, worker_id)
            attempt = tracing.tracer().child(
                req.trace, tracing.SPAN_CLIENT_REQUEST, worker_id=worker_id_hex(worker_id), attempt=req.migrations,
                stage=choice.stage, remote_prefill=outcome is not None and outcome.remote,
            )
            router = req.model.router
            assert router is not None
            # Remote prefill: the prompt's cache hits happened on the prefill worker.
            remote_cached = outcome.cached_tokens if outcome is not None and outcome.remote else None
            if remote_cached is not None:
                req.cached_tokens = remote_cached
            # The worker continues the trace from this span (or the unsampled root: it records nothing).
            with tracing.use_span(attempt or req.trace):
                stream = pool.client.stream_to(instance, self._attempt_body(choice, outcome), request_id=request_id)
            self._stream = stream
            first = True
            try:
                async for out in stream:
                    tokens = out.get("token_ids")
                    finish = out.get("finish_reason")
                    if tokens:
                        if first:
                            first = False
                            if attempt is not None:
                                attempt.set("ttft_ms", ms_between_ns(attempt.start_unix_ns, time.time_ns()))
                            router.on_first_token(request_id)
                            if outcome is not None and not req.migrations:
                                self._d.prefill_stage.first_token(outcome)
                            if outcome is not None and outcome.remote:
                                _note_transfer(req, out)
                        generated.extend(tokens)
                    usage = out.get("usage")
                    if usage and remote_cached is None:
                        req.cached_tokens = min(int(usage.get("cached_tokens") or 0), prompt_len)
                    if usage and req.preprocessed.pin is not None:
                        req.pinned_tokens = int(usage.get("pinned_tokens") or 0)
                        req.pin_refused = bool(usage.get("pin_refused"))
                        model_metrics.pin_outcome(req.pinned_tokens, req.pin_refused)
                    if finish == FINISH_ABORT:
                        if tokens:
                            yield {"token_ids": tokens, "log_probs": out.get("log_probs")}
                        raise WorkerAborted(f"worker {worker_id:x} aborted the request")
                    if finish is not None:
                        req.finish_reason = finish
                    yield out
                    if finish is not None:
                        return
                raise TransportError(f"worker {worker_id:x} ended the stream without a finish reason")
            except _MIGRATABLE as exc:
                if attempt is not None:
                    attempt.fail(exc)
                # A worker that left discovery is routed to by nobody already; quarantining it
                # would only delay it when its record comes back (a frozen worker thawing).
                if isinstance(exc, TransportError) and not isinstance(exc, InstanceGoneError):
                    self._d.report_dead(worker_id)
                exclude.add(worker_id)
                if req.direct_ids is not None or req.migrations >= req.migration_limit:
                    logger.warning(
                        "request failed without migration request_id=%s worker_id=%016x migrations=%d error=%s",
                        request_id, worker_id, req.migrations, exc,
                    )
                    raise
                req.migrations += 1
                migrating = migration_span(req, worker_id, exc)
                (model_metrics.migrate_ongoing if generated else model_metrics.migrate_new).inc()
                logger.info(
                    "request migrating request_id=%s from_worker=%016x generated=%d attempt=%d error=%s",
                    request_id, worker_id, len(generated), req.migrations, exc,
                )
                if self.max_tokens is not None and len(generated) >= self.max_tokens:
                    if migrating is not None:
                        migrating.set("outcome", "budget_spent")
                        migrating.end()
                        migrating = None
                    req.finish_reason = FINISH_LENGTH
                    yield {"token_ids": [], "finish_reason": FINISH_LENGTH}
                    return
            except Exception as exc:
                if attempt is not None:
                    attempt.fail(exc)
                raise
            finally:
                self._stream = None
                router.on_finish(request_id)
                if attempt is not None:
                    attempt.update({"completion_tokens": len(generated), "finish_reason": req.finish_reason})
                    attempt.end()
                await stream.aclose()


def _note_transfer(req: EngineRequest, out: dict[str, Any]) -> None:
    """Keeps the decode worker's KV transfer report (the mocker sends it with the first token) for
    the route explanation."""
    params = out.get("disaggregated_params")
    report = params.get("kv_transfer") if isinstance(params, dict) else None
    if isinstance(report, dict):
        req.kv_transfer = report
