"""One way through the pipeline for every generating endpoint: the door, admission, ``serve``.

    bytes -> decode (the surface's typed request) -> cost and admission -> model
          -> FrontendRequest (at the door) -> run_admitted -> respond -> serve(request, writer)
          -> start (the surface plans the prompt and opens the generation) -> first delta
          -> writer.write (the output format: SSE chunks, one JSON body, Responses events...)

``GenerationEndpoint`` is what an API surface subclasses: it says how to decode its body
(``decode``), how to plan and open a generation (``start``) and which ``ResponseWriter`` formats
the reply (``writer``); the door, the admission bookkeeping and ``serve`` are written once here.
The OpenAI chat, completions and Responses endpoints are such subclasses; another surface (the
Anthropic Messages API) adds its own ``decode``/``start`` and a writer for its events.

Everything up to the first generated token can still fail with a proper HTTP status (the first
delta is awaited before a writer sends anything), so a bad LoRA name or a missing worker is a
4xx/503 rather than a broken stream; the writer's ``refuse`` gives it the surface's error shape.
After that, a failure is the writer's to report in-band.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, Generic

from dynamod.daemon.frontend.http.asgi import DisconnectWatch, Scope, read_body, send_error
from dynamod.daemon.frontend.http.errors import to_http_error
from dynamod.daemon.frontend.http.request_id import SCOPE_REQUEST_ID_GIVEN, request_id_of
from dynamod.daemon.frontend.pipeline.generation import Delta, TextGeneration
from dynamod.daemon.frontend.pipeline.metrics import STATUS_CANCELLED, STATUS_ERROR, STATUS_SUCCESS
from dynamod.daemon.frontend.pipeline.pieces import (
    OutputSplitter,
    Piece,
    all_pieces,
    output_splitter,
    streamed_pieces,
)
from dynamod.daemon.frontend.pipeline.priority import with_header_priority
from dynamod.daemon.frontend.pipeline.request import (
    BodyT,
    EngineRequest,
    FrontendRequest,
    Plan,
    wants_explain,
)
from dynamod.daemon.frontend.pipeline.state import FrontendState
from dynamod.daemon.frontend.pipeline.tracing import finish_request_span, start_request_span
from dynamod.shared.observability import tracing
from dynamod.shared.observability.logging import REQUEST_ID as LOG_REQUEST_ID
from dynamod.shared.protocol.llm import PreprocessedRequest, SamplingOptions, StopConditions

logger = logging.getLogger(__name__)


class ResponseWriter(ABC):
    """One output format of one request: how its generation goes out on the wire.

    ``serve`` calls ``refuse`` when the request fails before anything was sent, ``write`` with the
    first delta once it has arrived (the writer sends the headers, the rest of the deltas and the
    end), and ``completed`` after a response that ended well (the Responses writer stores it)."""

    def __init__(self, request: FrontendRequest[Any]) -> None:
        self.request = request

    async def refuse(self, exc: BaseException, response_id: str | None = None) -> None:
        """Nothing sent yet: the failure as an HTTP error (OpenAI's error body by default), naming
        ``response_id`` (default the request id). The client watch ends first: the server reports
        the end of the response as a disconnect."""
        request = self.request
        request.watch.done()
        await send_error(request.send, to_http_error(exc, request_id=response_id or request.request_id))

    @abstractmethod
    async def write(self, gen: TextGeneration, first: Delta) -> bool:
        """Sends the whole response from ``first`` on; False when it ended with an error reported
        to the client (in-band on a stream, an error body otherwise)."""

    def completed(self, gen: TextGeneration) -> None:  # noqa: B027 - an optional hook, not abstract
        """The response ended well (after the metrics were counted)."""

    def splitter(self) -> OutputSplitter:
        """How the generated text divides into answer, reasoning and tool calls: by the output
        parser the request's plan built (None: all answer text). For the writers that build items
        or blocks of each kind (Responses, Anthropic)."""
        plan = self.request.plan
        return output_splitter(plan.parser if plan is not None else None)

    async def collect(
        self, gen: TextGeneration, first: Delta, add: Callable[[list[Piece]], object], response_id: str | None = None
    ) -> Delta | None:
        """A unary response's whole generation from ``first`` on, its pieces handed to ``add`` (the
        writer's builder); returns the last delta. A failure on the way is refused as an error body
        naming ``response_id`` (nothing was sent yet) and returns None."""
        try:
            pieces, delta = await all_pieces(gen, first, self.splitter())
            add(pieces)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - nothing sent yet: an error body
            await self.refuse(exc, response_id)
            return None
        return delta

    async def end_stream(self, body: bytes) -> None:
        """Sends the last bytes of a streamed response (its closing events or its in-band error).
        The client watch ends first: the server reports the end of the response as a disconnect."""
        request = self.request
        request.watch.done()
        await request.send({"type": "http.response.body", "body": body, "more_body": False})

    async def stream(
        self, gen: TextGeneration, first: Delta, body: bytes, add: Callable[[list[Piece]], bytes]
    ) -> tuple[bytes, Delta]:
        """A streamed response's generation from ``first`` on: ``add`` (the writer's builder) turns
        each delta's pieces into event bytes, sent as they come after ``body`` (the opening
        events). Returns what the last delta added, unsent (the writer appends the closing events
        and ends the stream with it), and the last delta."""
        send = self.request.send
        delta = first
        async for pieces, delta in streamed_pieces(gen, first, self.splitter()):
            body += add(pieces)
            if body and delta.finish_reason is None:
                await send({"type": "http.response.body", "body": body, "more_body": True})
                body = b""
        return body, delta


async def run_admitted(
    state: FrontendState, request: FrontendRequest[Any], endpoint: str, cost: int,
    respond: Callable[[], Awaitable[str]],
) -> None:
    """Runs one admitted request's ``respond()`` (it returns the request's metrics status) with the
    bookkeeping every endpoint shares: the admission count and in-flight gauge, a client that hangs
    up (its cancel absorbed, counted and logged), the duration and the request counter.
    ``cost``: the generations it runs (prompts x n), each counted against ``--max-inflight``."""
    state.admit(cost)
    model = request.model
    mm = model.metrics
    mm.inflight.inc()
    status = STATUS_ERROR
    watch = request.watch
    try:
        status = await respond()
    except asyncio.CancelledError:
        if not watch.absorb_cancel():
            raise
        status = STATUS_CANCELLED
        mm.disconnects.inc()
        logger.info("client disconnected request_id=%s model=%s action=aborted", request.request_id, model.name)
    finally:
        watch.done()
        mm.inflight.dec()
        state.release(cost)
        mm.duration.observe(time.perf_counter() - request.started_at)
        state.metrics.count_request(model.name, endpoint, request.stream, status)
        finish_request_span(request, status)


class GenerationEndpoint(ABC, Generic[BodyT]):
    """An ASGI endpoint that generates text: the door and ``serve``; the surface fills in the rest."""

    endpoint_name = ""  # the metrics' endpoint label

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    # -- what a surface says ----------------------------------------------------------------------

    @abstractmethod
    def decode(self, body: bytes) -> BodyT:
        """The validated request (``InvalidRequestError`` naming the bad parameter)."""

    @abstractmethod
    def model_name(self, body: BodyT) -> str:
        """The model the request names."""

    def wants_stream(self, body: BodyT) -> bool:
        return bool(getattr(body, "stream", False))

    def admit(self, scope: Scope, body: BodyT) -> int:
        """Admits a decoded request; returns the generations it will run (its cost). Raises the
        error the client gets (503 while draining or at ``--max-inflight``)."""
        refusal = self.state.admission_refusal()
        if refusal is not None:
            raise refusal[1]
        return 1

    @abstractmethod
    async def start(self, request: FrontendRequest[BodyT]) -> TextGeneration:
        """Plans the request (``request.plan``) and opens its generation (not yet awaited)."""

    @abstractmethod
    def writer(self, request: FrontendRequest[BodyT]) -> ResponseWriter:
        """The output format of this request."""

    async def refuse(self, send: Any, exc: BaseException, request_id: str) -> None:
        """A request refused at the door (bad body, unknown model, over a limit)."""
        await send_error(send, to_http_error(exc, request_id=request_id))

    async def respond(self, request: FrontendRequest[BodyT]) -> str:
        """Runs an admitted request; returns its metrics status (a surface with several
        generations per request sends those elsewhere)."""
        return await self.serve(request, self.writer(request))

    # -- the door and the one pipeline ------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        start = time.perf_counter()
        state = self.state
        # The doors gave the request its x-request-id; one the client chose may repeat across its
        # requests, so the engines get an id of their own then (the spans and logs carry both).
        client_id = request_id_of(scope)
        request_id = client_id if client_id is not None and not scope.get(SCOPE_REQUEST_ID_GIVEN) else uuid.uuid4().hex
        client_id = client_id or request_id
        log_token = LOG_REQUEST_ID.set(client_id)
        trace = start_request_span(scope, client_id, self.endpoint_name)
        if trace is not None and client_id != request_id:
            trace.set("engine_request_id", request_id)
        try:
            try:
                body = self.decode(await read_body(receive))
                cost = self.admit(scope, body)
                model = state.registry.get(self.model_name(body))
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
                state.metrics.count_request("unknown", self.endpoint_name, False, STATUS_ERROR)
                if trace is not None:
                    trace.fail(exc)
                    trace.end()
                await self.refuse(send, exc, request_id)
                return
            if trace is not None:
                trace.set("model", model.name)
            request = FrontendRequest(
                request_id=request_id, scope=scope, send=send, body=body, model=model, started_at=start,
                watch=DisconnectWatch(receive), stream=self.wants_stream(body), explain=wants_explain(scope),
                trace=trace,
            )
            await run_admitted(state, request, self.endpoint_name, cost, lambda: self.respond(request))
        finally:
            LOG_REQUEST_ID.reset(log_token)

    async def serve(self, request: FrontendRequest[BodyT], writer: ResponseWriter) -> str:
        """Runs one admitted single-generation request through ``writer``; returns its metrics
        status. The engine request is closed on every way out (end, error, client gone)."""
        gen: TextGeneration | None = None
        try:
            try:
                preprocess = tracing.tracer().child(request.trace, tracing.SPAN_PREPROCESS)
                # Calls made while planning (an encode worker for images) continue the trace.
                with tracing.use_span(preprocess or request.trace):
                    gen = await self.start(request)
                if preprocess is not None:
                    preprocess.set("prompt_tokens", gen.prompt_tokens)
                    preprocess.end()
                first = await gen.__anext__()
            except Exception as exc:  # noqa: BLE001 - nothing sent yet: a proper HTTP error
                if request.trace is not None:
                    request.trace.fail(exc)
                await writer.refuse(exc)
                return STATUS_ERROR
            mm = gen.metrics
            now = time.perf_counter()
            if request.trace is not None:  # rounded when the root is recorded (finish_request_span)
                request.trace.attributes["ttft_ms"] = (now - request.started_at) * 1000.0
            mm.observe_ttft(now - request.started_at, gen.request.preprocessed.priority)
            mm.isl.observe(gen.prompt_tokens)
            if not await writer.write(gen, first):
                return STATUS_ERROR
            mm.osl.observe(gen.completion_tokens)
            mm.usage(gen.prompt_tokens, gen.cached_tokens)
            engine = gen.request
            if engine.worker_id is not None:
                self.state.metrics.worker_latency(
                    engine.worker_id, now - request.started_at, time.perf_counter() - now, gen.completion_tokens,
                    engine.disagg,
                )
            writer.completed(gen)
            return STATUS_SUCCESS
        finally:
            if gen is not None:
                await gen.aclose()

    def open_generation(
        self, request: FrontendRequest[BodyT], plan: Plan, request_id: str, sampling: SamplingOptions | None = None
    ) -> TextGeneration:
        """Routes one generation of ``plan`` and opens its engine stream (not yet awaited); each
        choice of a fan-out request is one such generation, with its own id and seed (``sampling``:
        default the plan's)."""
        model = request.model
        pre = request.preprocessor
        sampling = sampling if sampling is not None else plan.sampling
        assert pre is not None and sampling is not None  # start() sets both before opening
        preq = PreprocessedRequest(
            request_id=request_id,
            model=model.card.base_model or model.name,
            token_ids=plan.prompt_ids,
            sampling=sampling,
            stop=StopConditions(
                max_tokens=plan.max_tokens,
                min_tokens=plan.min_tokens,
                stop_token_ids=plan.stop_token_ids,
                ignore_eos=plan.ignore_eos,
            ),
            lora_name=model.lora_name,
            router=plan.sla,
            routing=with_header_priority(plan.routing, request.scope),
            pin=plan.pin,
            mm_items=plan.mm_items,
        )
        engine_request = EngineRequest(
            request_id=request_id, model=model, preprocessed=preq, started_at=request.started_at,
            direct_ids=request.direct_ids, migration_limit=model.card.migration_limit, session=request.session,
            trace=request.trace,
        )
        if request.engine is None:
            request.engine = engine_request
        engine = self.state.dispatcher.open(engine_request)
        markers = plan.parser.markers if plan.parser is not None else ()
        detokenizer = pre.detokenizer(plan.prompt_ids, markers)
        return TextGeneration(engine, detokenizer, plan.stops, want_logprobs=plan.logprobs is not None)

