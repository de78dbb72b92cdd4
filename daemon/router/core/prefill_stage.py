"""The prefill stage of disaggregated serving: one implementation for the frontend and the router role.

Per request (and again per migration attempt, with the tokens generated so far in the prompt):

1. the caller's ``PrefillTarget`` picks a prefill worker (KV-aware over the pool's own events, or
   round-robin/random); a KV-aware pool counts the prompt as queued there until ``done`` or
   ``discard``;
2. ``disagg_policy.decide`` says remote or local, from the prompt length, what the chosen *decode*
   worker caches, queues and runs (asked only when the policy is conditional), the prefill
   worker's queue and cached prefix, and (``cost`` policy) the transfer bandwidth and what each
   path cost beyond its prediction on earlier requests of the prompt's size (``PathOverhead``,
   fed by the caller's ``first_token`` when the request's first token arrives); a picked prefill
   worker that is not used hears so (``discard``), so its queue is not counted twice;
3. remote: the prompt goes to the prefill worker with ``prefill_only=True`` and ``max_tokens=1``;
   the first frame carrying ``disaggregated_params`` ends the stage (the final frame for the
   mocker without overlap, vLLM and TensorRT-LLM; an early one for SGLang, whose prefill runs on
   while decode starts, and for the mocker with ``--kv-transfer-overlap chunk``, whose *streaming*
   parameters come when the prompt is admitted and whose blocks the decode worker reads as they
   are computed). The rest of that stream is drained by a background task the caller owns and
   closes. A streamed prefill stays counted on its prefill worker (``done``) until that stream
   ends: its prompt is still queued work there.

A prefill that fails (an error, a broken stream, no params within ``prefill_timeout_s``) is tried
once more on another prefill worker, then prefilled locally on the decode worker when
``decode_fallback`` is on (``prefill_failed``), else the request fails with 503. No prefill worker
at all: local (``no_prefill_workers``), or 503 without the fallback.

What differs between callers (how workers are found, reached and quarantined) is the
``PrefillTarget`` protocol; the decision, retries, deadline, draining and metrics live here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

from dynamod.daemon.router.core.disagg_cost import (
    ComputeModel,
    PathOverhead,
    PathView,
    RecentSamples,
    TransferEstimate,
)
from dynamod.daemon.router.core.disagg_policy import (
    POLICY_COST,
    REASON_COST_LOCAL,
    REASON_COST_REMOTE,
    REASON_NO_PREFILL_WORKERS,
    DisaggInputs,
    DisaggPolicyConfig,
    decide,
    prefill_failed,
)
from dynamod.shared.errors import DynamoError, TransportError, UnavailableError
from dynamod.shared.observability.metrics import LATENCY_BUCKETS
from dynamod.shared.protocol.llm import FINISH_ABORT, FINISH_ERROR, PreprocessedRequest
from dynamod.shared.protocol.routing import DISAGG_REMOTE, DisaggInfo
from dynamod.shared.protocol.worker_id import worker_id_hex, worker_id_or_dash

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_TIMEOUT_S = 30.0
PREFILL_ATTEMPTS = 2  # the chosen prefill worker, then one other
MAX_TRACKED_DECODE_WORKERS = 1024
_NO_OVERHEAD = PathView(0.0, False, True)  # a policy other than cost: nothing learned weighs

# dynamo_*_prefill_failures_total{reason}
FAIL_TIMEOUT = "timeout"
FAIL_STREAM_BROKEN = "stream_broken"
FAIL_ERROR = "error"
FAIL_NO_PARAMS = "no_params"


class PrefillFailed(DynamoError):
    """One prefill attempt did not produce transfer parameters; ``reason`` is a FAIL_* word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class PrefillPick:
    """A prefill worker chosen for one attempt. ``handle`` is the pool's own (instance, route
    choice...): the orchestrator only hands it back."""

    worker_id: int
    dp_rank: int | None
    handle: Any
    overlap_blocks: int = 0
    load: float | None = None  # queued prefill tokens there, when the pool knows them
    cached_tokens: int = 0  # the prompt's prefix cached there (overlap_blocks * block size, capped)


@dataclass(slots=True)
class DecodeHint:
    """The chosen decode worker's view of the prompt, for the conditional policies and the decode
    guard: its cached prefix, KV fraction, queued prefill tokens and running decodes, and the KV
    transfer estimate from the transfers it reported (None: the policy's configured one)."""

    cached_tokens: int = 0
    kv_fraction: float | None = None
    worker_id: int | None = None
    queued_tokens: int = 0
    running: int = 0
    transfer: TransferEstimate | None = None


class PrefillTarget(Protocol):
    """The prefill workers of one model as a caller reaches them."""

    async def pick(self, request: PreprocessedRequest, exclude: set[int]) -> PrefillPick | None:
        """A ready prefill worker not in ``exclude``, or None when there is none."""
        ...

    def open(self, pick: PrefillPick, body: PreprocessedRequest) -> AsyncIterator[Any]:
        """The prefill request's output stream on the picked worker."""
        ...

    def sent(self, pick: PrefillPick, body: PreprocessedRequest) -> None:
        """The prefill request went out (publish the routing decision, count in-flight load)."""
        ...

    def done(self, pick: PrefillPick, body: PreprocessedRequest, error: Exception | None) -> None:
        """The attempt ended: ``error`` is what failed it (a ``TransportError`` means the worker is
        unreachable), None when params arrived or the caller cancelled."""
        ...

    def discard(self, pick: PrefillPick, request: PreprocessedRequest) -> None:
        """The pick was not used (the prompt is prefilled locally): stop counting it there."""
        ...


@dataclass(slots=True)
class PrefillOutcome:
    """What the decode stage needs: where the prompt was prefilled and how to fetch its KV."""

    info: DisaggInfo
    params: dict[str, Any] | None = None  # None: the decode worker prefills locally
    cached_tokens: int | None = None  # prompt tokens the prefill worker found cached
    pick: PrefillPick | None = None
    duration_s: float = 0.0
    failures: list[str] = field(default_factory=list)  # FAIL_* of the attempts that failed
    started: float = 0.0  # time.perf_counter() when the stage began (the TTFT the policy predicts starts here)

    @property
    def remote(self) -> bool:
        return self.params is not None


class DisaggMetrics:
    """Decision, duration and failure counters; ``prefix`` is ``dynamo_frontend`` or ``dynamo_router``."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.decisions = Counter(
            f"{prefix}_disagg_decisions",
            "Disaggregation decisions: prompt prefilled on the prefill pool (remote) or its decode worker (local)",
            ("model", "mode", "reason"),
            registry=registry,
        )
        self.prefill_duration = Histogram(
            f"{prefix}_prefill_duration_seconds",
            "Remote prefill stage: request sent to the prefill worker until its transfer parameters arrived",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_failures = Counter(
            f"{prefix}_prefill_failures",
            "Remote prefill attempts that gave no transfer parameters, by reason",
            ("model", "reason"),
            registry=registry,
        )


def prefill_body(request: PreprocessedRequest, pick: PrefillPick) -> PreprocessedRequest:
    """The prefill-only request: the prompt, one token, on the picked rank."""
    stop = msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=None)
    return msgspec.structs.replace(
        request, prefill_only=True, stop=stop, disaggregated_params=None, dp_rank=pick.dp_rank,
        estimated_prefix_hit_blocks=pick.overlap_blocks or None,
    )


def decode_body(request: PreprocessedRequest, outcome: PrefillOutcome) -> PreprocessedRequest:
    """The decode request: the original one plus the prefill worker's transfer parameters."""
    if outcome.params is None:
        return request
    return msgspec.structs.replace(request, disaggregated_params=outcome.params)


class PrefillStage:
    """Shared by all requests of a process: the policy, the prefill deadline and the metrics."""

    def __init__(
        self,
        policy: DisaggPolicyConfig,
        metrics: DisaggMetrics,
        *,
        prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
        busy_threshold: float | None = None,
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self.prefill_timeout_s = prefill_timeout_s
        self.busy_threshold = busy_threshold  # prefill_busy_threshold when the policy sets none
        # The cost policy's compute model, loaded now so that a bad profile fails at start-up.
        self.compute: ComputeModel | None = (
            policy.profile_compute() if policy.enabled and policy.policy == POLICY_COST else None
        )
        # The decode worker of a prompt kept local: by its prefill's predicted time there (None: policy off).
        self.local_prefill = policy.local_prefill_choice(self.compute)
        # What each path costs beyond its prediction, from measured first tokens (``first_token``).
        self.local_overhead = PathOverhead()
        self.remote_overhead = PathOverhead()
        # Per decode worker: the tokens of the recent remote prefills sent its way (what it had to
        # pull), to pair with the transfer times it reports. Bounded: workers come and go.
        self._transfer_tokens: dict[int, RecentSamples] = {}

    def transfer_estimate(self, decode_worker_id: int, transfer_ms_p50: float) -> TransferEstimate:
        """The cost policy's transfer estimate for a decode worker from the median transfer time
        it reports (the policy's configured bandwidth until both figures exist)."""
        tokens = self._transfer_tokens.get(decode_worker_id)
        p50_tokens = tokens.quantile(0.5) if tokens is not None else 0.0
        return self.policy.transfer.measured(transfer_ms_p50, p50_tokens)

    def _note_transfer(self, info: DisaggInfo) -> None:
        wid = info.decode_worker_id
        if wid is None:
            return
        samples = self._transfer_tokens.get(wid)
        if samples is None:
            if len(self._transfer_tokens) >= MAX_TRACKED_DECODE_WORKERS:
                self._transfer_tokens.pop(next(iter(self._transfer_tokens)))
            samples = self._transfer_tokens[wid] = RecentSamples()
        samples.add(info.effective_isl)

    async def run(
        self,
        request: PreprocessedRequest,
        pool: PrefillTarget,
        decode_hint: Callable[[], DecodeHint],
        *,
        model: str,
        drains: list[asyncio.Task[None]],
    ) -> PrefillOutcome:
        """Decides and, when remote, runs the prefill; a background drain task is appended to
        ``drains`` (the caller cancels it when the request ends). Raises ``UnavailableError`` when
        the prompt can be prefilled nowhere (no prefill worker or prefill failed, no fallback)."""
        started = time.perf_counter()
        pick = await pool.pick(request, set())
        hint = decode_hint() if self.policy.enabled and pick is not None else DecodeHint()
        isl = len(request.token_ids)
        # The learned overheads and exploration state weigh only in the cost policy.
        local, remote = (
            (self.local_overhead.view(isl), self.remote_overhead.view(isl)) if self.compute is not None
            else (_NO_OVERHEAD, _NO_OVERHEAD)
        )
        info = decide(
            self.policy,
            DisaggInputs(
                isl=isl,
                decode_cached_tokens=hint.cached_tokens,
                prefill_available=pick is not None,
                prefill_load=None if pick is None else pick.load,
                prefill_busy_threshold=self.busy_threshold,
                decode_kv_fraction=hint.kv_fraction,
                prefill_worker_id=None if pick is None else pick.worker_id,
                decode_worker_id=hint.worker_id,
                decode_queued_tokens=hint.queued_tokens,
                running_decodes=hint.running,
                prefill_cached_tokens=0 if pick is None else pick.cached_tokens,
                transfer=hint.transfer,
                local_overhead_ms=local.ms,
                remote_overhead_ms=remote.ms,
                local_measuring=not local.may_explore,
                remote_measuring=not remote.may_explore,
                remote_measured=remote.measured,
            ),
            self.compute,
        )
        if info.reason == REASON_COST_REMOTE:
            self.remote_overhead.explored(isl, info.cost.remote_ttft_ms if info.cost else 0.0)
        elif info.reason == REASON_COST_LOCAL:
            self.local_overhead.explored(isl, info.cost.local_ttft_ms if info.cost else 0.0)
        if pick is not None and info.mode == DISAGG_REMOTE:
            info.prefill_dp_rank = pick.dp_rank
        outcome = PrefillOutcome(info=info, started=started)
        if info.mode != DISAGG_REMOTE:
            if pick is not None:
                pool.discard(pick, request)
            if info.reason == REASON_NO_PREFILL_WORKERS and not self.policy.decode_fallback:
                self._count(model, info)
                raise UnavailableError(
                    f"no ready prefill worker serves model {model!r} and decode fallback is off (--no-decode-fallback)"
                )
            return self._finish(model, request, outcome)
        tried: set[int] = set()
        last_error = ""
        while pick is not None:
            tried.add(pick.worker_id)
            try:
                return self._finish(model, request, await self._attempt(request, pool, pick, model, outcome, drains))
            except PrefillFailed as exc:
                outcome.failures.append(exc.reason)
                self.metrics.prefill_failures.labels(model, exc.reason).inc()
                logger.warning(
                    "prefill failed request_id=%s prefill_worker=%s reason=%s attempt=%d error=%s",
                    request.request_id, worker_id_hex(pick.worker_id), exc.reason, len(tried), exc,
                )
                last_error = str(exc)
            if len(tried) >= PREFILL_ATTEMPTS:
                break
            pick = await pool.pick(request, tried)
        outcome.info = prefill_failed(info, last_error)
        if not self.policy.decode_fallback:
            self._count(model, outcome.info)
            raise UnavailableError(
                f"prefill failed on {len(tried)} prefill worker(s) for model {model!r} and decode fallback is off: {last_error}"
            )
        return self._finish(model, request, outcome)

    async def _attempt(
        self,
        request: PreprocessedRequest,
        pool: PrefillTarget,
        pick: PrefillPick,
        model: str,
        outcome: PrefillOutcome,
        drains: list[asyncio.Task[None]],
    ) -> PrefillOutcome:
        body = prefill_body(request, pick)
        stream = pool.open(pick, body)
        pool.sent(pick, body)
        started = time.perf_counter()
        handed_off = False
        streaming = False
        error: Exception | None = None
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                while True:
                    try:
                        out = await anext(stream)
                    except StopAsyncIteration:
                        raise PrefillFailed(FAIL_STREAM_BROKEN, "the prefill stream ended without transfer parameters") from None
                    params = out.get("disaggregated_params") if isinstance(out, dict) else None
                    if params is not None:
                        break
                    finish = out.get("finish_reason") if isinstance(out, dict) else None
                    if finish in (FINISH_ERROR, FINISH_ABORT):
                        raise PrefillFailed(FAIL_ERROR, f"the prefill worker ended with {finish}: {out.get('error') or 'no detail'}")
                    if finish is not None:
                        raise PrefillFailed(FAIL_NO_PARAMS, f"the prefill worker finished ({finish}) without transfer parameters")
        except TimeoutError:
            error = PrefillFailed(FAIL_TIMEOUT, f"no transfer parameters within {self.prefill_timeout_s:.1f}s")
            raise error from None
        except TransportError as exc:
            error = exc
            raise PrefillFailed(FAIL_STREAM_BROKEN, str(exc)) from exc
        except PrefillFailed as exc:
            error = exc
            raise
        except DynamoError as exc:
            error = exc
            raise PrefillFailed(FAIL_ERROR, str(exc)) from exc
        else:
            outcome.duration_s = time.perf_counter() - started
            outcome.params = params
            outcome.pick = pick
            outcome.cached_tokens = _cached_tokens(out, params, len(request.token_ids))
            self.metrics.prefill_duration.labels(model).observe(outcome.duration_s)
            streaming = isinstance(params, dict) and params.get("streaming") is True

            def ended(exc: Exception | None) -> None:
                if streaming:
                    pool.done(pick, body, exc)

            drains.append(
                asyncio.create_task(_drain(stream, request.request_id, ended), name=f"prefill-drain:{request.request_id}")
            )
            handed_off = True
            return outcome
        finally:
            if not (handed_off and streaming):
                pool.done(pick, body, error)
            if not handed_off:
                await stream.aclose()  # type: ignore[attr-defined]

    def first_token(self, outcome: PrefillOutcome, now: float | None = None) -> None:
        """The request's first token reached the caller (``now``: ``time.perf_counter()``): its
        TTFT from the stage's start, against the prediction of the path the cost policy chose,
        teaches that path's ``PathOverhead``. Other decisions (a failed prefill, other policies, a
        remote prefill that ran on another worker than the one predicted) teach nothing."""
        info = outcome.info
        cost = info.cost
        if cost is None or outcome.started <= 0.0:
            return
        measured_ms = ((time.perf_counter() if now is None else now) - outcome.started) * 1000.0
        if info.reason == REASON_COST_LOCAL and not outcome.remote:
            self.local_overhead.observe(info.isl, measured_ms, cost.local_ttft_ms - cost.local_overhead_ms)
        elif (
            info.reason == REASON_COST_REMOTE and outcome.remote and outcome.pick is not None
            and outcome.pick.worker_id == info.prefill_worker_id
        ):
            self.remote_overhead.observe(info.isl, measured_ms, cost.remote_ttft_ms - cost.remote_overhead_ms)

    def _finish(self, model: str, request: PreprocessedRequest, outcome: PrefillOutcome) -> PrefillOutcome:
        info = outcome.info
        self._count(model, info)
        if outcome.remote:
            self._note_transfer(info)
        cost = info.cost
        logger.info(
            "disagg decision request_id=%s mode=%s reason=%s policy=%s isl=%d effective_isl=%d prefill_worker=%s "
            "decode_worker=%s%s",
            request.request_id, info.mode, info.reason, info.policy, info.isl, info.effective_isl,
            worker_id_or_dash(None if outcome.pick is None else outcome.pick.worker_id), worker_id_or_dash(info.decode_worker_id),
            "" if cost is None else (
                f" local_cost_ms={cost.local_cost_ms:.1f} remote_cost_ms={cost.remote_cost_ms:.1f}"
                f" decode_queued_tokens={cost.local_queued_tokens} running_decodes={cost.running_decodes}"
                f" prefill_queued_tokens={cost.remote_queued_tokens} transfer_ms={cost.transfer_ms:.1f}"
                f" local_overhead_ms={cost.local_overhead_ms:.1f} remote_overhead_ms={cost.remote_overhead_ms:.1f}"
            ),
        )
        return outcome

    def _count(self, model: str, info: DisaggInfo) -> None:
        self.metrics.decisions.labels(model, info.mode, info.reason).inc()


def _cached_tokens(frame: dict[str, Any], params: Any, isl: int) -> int | None:
    """The prefill worker's cached prompt tokens: its usage, else the mocker's transfer params."""
    usage = frame.get("usage")
    value = usage.get("cached_tokens") if isinstance(usage, dict) else None
    if value is None and isinstance(params, dict):
        value = params.get("cached_tokens")
    return None if value is None else min(int(value), isl)


async def _drain(stream: AsyncIterator[Any], request_id: str, ended: Callable[[Exception | None], None]) -> None:
    """Reads the prefill stream to its end (SGLang's and a streamed mocker's prefill runs on after
    its early params); cancelling the task closes the stream, which cancels the prefill request on
    the worker. ``ended`` hears how it ended (the error that broke it, else None)."""
    error: Exception | None = None
    try:
        async for out in stream:
            if isinstance(out, dict) and out.get("finish_reason") == FINISH_ERROR:
                logger.warning("prefill failed after its params request_id=%s error=%s", request_id, out.get("error"))
    except DynamoError as exc:
        error = exc
        logger.info("prefill stream ended early request_id=%s error=%s", request_id, exc)
    finally:
        with contextlib.suppress(DynamoError):
            await stream.aclose()  # type: ignore[attr-defined]
        ended(error)


async def close_drains(drains: list[asyncio.Task[None]]) -> None:
    """Ends the request's prefill streams still open (the decode stream ended or failed)."""
    pending = [t for t in drains if not t.done()]
    drains.clear()
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
