"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one pipeline, two formats.

    body -> validated request -> model -> prompt token ids -> context check -> EngineStream
         -> TextGeneration (detokenize, stop strings) -> [chat: OutputParser] -> SSE chunks or one JSON body

Chat replies of a model whose card names a tool-call or reasoning parser go through an
``OutputParser`` (``parsers/``) built per request: tool calls come back as ``tool_calls``,
reasoning as ``reasoning_content``. No parser, no cost: the text goes straight to ``content``.
A request with several choices (``n > 1``, batched completion prompts) goes to ``fanout.py``,
which runs this pipeline's steps once per choice; ``n=1`` never touches it.

Everything up to the first generated token can still fail with a proper HTTP status (the first
delta is awaited before the response starts), so a bad LoRA name or a missing worker is a 4xx/503
rather than a broken stream. After that, an error is sent as an SSE ``error`` event, which the
official client raises as ``APIError``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from dynamod.daemon.frontend import fanout
from dynamod.daemon.frontend.asgi import DisconnectWatch, Scope, header, read_body, send_error, send_json
from dynamod.daemon.frontend.errors import to_http_error
from dynamod.daemon.frontend.fanout import fans_out
from dynamod.daemon.frontend.formatters import (
    SSE_DONE,
    ChatFormatter,
    CompletionFormatter,
    LogprobCollector,
    make_usage,
    sse_safe,
)
from dynamod.daemon.frontend.generation import IDLE, Delta, TextGeneration
from dynamod.daemon.frontend.metrics import (
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    STATUS_CANCELLED,
    STATUS_ERROR,
    STATUS_SUCCESS,
)
from dynamod.daemon.frontend.models import ServedModel
from dynamod.daemon.frontend.parsers import OutputParser, ToolSettings, build_output_parser
from dynamod.daemon.frontend.parsers.forced_tool_calls import forced_output_parser, forces_call
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor, completion_prompts
from dynamod.daemon.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_request,
    decode_completion_request,
)
from dynamod.daemon.frontend.request import EXPLAIN_HEADER, FrontendRequest
from dynamod.daemon.frontend.routing import header_candidates
from dynamod.daemon.frontend.sampling import sampling_options
from dynamod.daemon.frontend.state import FrontendState
from dynamod.shared.errors import (
    ContextLengthError,
    InvalidRequestError,
)
from dynamod.shared.protocol.llm import PreprocessedRequest, SamplingOptions, StopConditions
from dynamod.shared.protocol.worker_id import worker_id_hex

logger = logging.getLogger(__name__)

WORKER_HEADER = b"x-dynamo-worker-instance-id"
REQUEST_ID_HEADER = b"x-request-id"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
DEFAULT_COMPLETION_MAX_TOKENS = 16
FALLBACK_MAX_TOKENS = 4096  # a card without a context length: some bound is needed
_EXPLAIN_ON = ("1", "true", "yes", "on")


def plan_max_tokens(prompt_len: int, requested: int | None, context_length: int, default: int | None) -> int:
    """The output budget, or ``ContextLengthError`` with the numbers when it cannot fit."""
    if context_length and prompt_len >= context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {context_length} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for the completion. Please shorten the prompt.",
            param="messages",
        )
    room = context_length - prompt_len if context_length else FALLBACK_MAX_TOKENS
    if requested is None:
        return min(default, room) if default is not None else room
    if context_length and prompt_len + requested > context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            "Please reduce the length of the prompt or the completion.",
            param="max_tokens",
        )
    return requested


def _route_headers(request: FrontendRequest, explain: bool) -> list[tuple[bytes, bytes]]:
    """The worker that answered and, when asked for and there is one, the route explanation.
    After a migration both name the last routing, the one that produced the answer."""
    headers = [(WORKER_HEADER, worker_id_hex(request.worker_id).encode())]
    if explain:
        value = request.explain_header()
        if value is not None:
            headers.append((EXPLAIN_HEADER, value.encode("latin-1")))
    return headers


class _Plan:
    """What the endpoint-specific part decides before generation starts."""

    __slots__ = ("prompt_ids", "max_tokens", "logprobs", "echo_text", "stops", "parser")

    def __init__(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        logprobs: int | None,
        echo_text: str,
        stops: list[str],
        parser: OutputParser | None = None,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.logprobs = logprobs
        self.echo_text = echo_text
        self.stops = stops
        self.parser = parser  # chat only: tool calls and reasoning in the output


async def run_admitted(
    state: FrontendState, model: ServedModel, endpoint: str, stream: bool, request_id: str, start: float,
    receive: Any, serve: Callable[[DisconnectWatch], Awaitable[str]], cost: int = 1,
) -> None:
    """Runs one admitted request's ``serve(watch)`` (it returns the request's metrics status) with
    the bookkeeping every endpoint shares: the admission count and in-flight gauge, a client that
    hangs up (its cancel absorbed, counted and logged), the duration and the request counter.
    ``cost``: the generations it runs (prompts x n), each counted against ``--max-inflight``."""
    state.admit(cost)
    mm = model.metrics
    mm.inflight.inc()
    status = STATUS_ERROR
    watch = DisconnectWatch(receive)
    try:
        status = await serve(watch)
    except asyncio.CancelledError:
        if not watch.absorb_cancel():
            raise
        status = STATUS_CANCELLED
        mm.disconnects.inc()
        logger.info("client disconnected request_id=%s model=%s action=aborted", request_id, model.name)
    finally:
        watch.done()
        mm.inflight.dec()
        state.release(cost)
        mm.duration.observe(time.perf_counter() - start)
        state.metrics.count_request(model.name, endpoint, stream, status)


class OpenAIEndpoint(ABC):
    """The shared pipeline; subclasses decode their request, build the prompt and pick a format."""

    endpoint_name = ""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    # -- endpoint-specific ------------------------------------------------------------------------

    @abstractmethod
    def decode(self, body: bytes) -> Any:
        """The validated request struct (``InvalidRequestError`` naming the bad parameter)."""

    @abstractmethod
    async def plan(self, req: Any, model: ServedModel, pre: ModelPreprocessor) -> _Plan:
        """Prompt token ids, output budget and the options generation needs."""

    @abstractmethod
    def formatter(self, req: Any, response_id: str, created: int, plan: _Plan) -> ChatFormatter | CompletionFormatter:
        """The response format of this endpoint."""

    @abstractmethod
    def _logprobs(self, collector: LogprobCollector | None, delta: Delta) -> Any:
        """The ``logprobs`` object of one chunk (None when not asked for or not given)."""

    @abstractmethod
    def _total_logprobs(self, collector: LogprobCollector | None) -> Any:
        """The ``logprobs`` object of a whole (unary) response."""

    # -- the pipeline -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        start = time.perf_counter()
        state = self.state
        request_id = uuid.uuid4().hex
        try:
            body = await read_body(receive)
            req = self.decode(body)
            cost = fanout.check_fanout(scope, req, state)  # prompts x n: capped, rate-charged, admitted
            model = state.registry.get(req.model)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            error = to_http_error(exc, request_id=request_id)
            state.metrics.count_request("unknown", self.endpoint_name, False, STATUS_ERROR)
            await send_error(send, error)
            return
        await run_admitted(
            state, model, self.endpoint_name, req.stream, request_id, start, receive,
            lambda watch: self._serve(scope, send, req, model, request_id, start, watch), cost,
        )

    async def _serve(
        self, scope: Scope, send: Any, req: Any, model: ServedModel, request_id: str, start: float, watch: DisconnectWatch
    ) -> str:
        """Runs one admitted request; returns its metrics status. The engine request is closed on
        every way out (end, error, client gone)."""
        gen: TextGeneration | None = None
        explain = (header(scope, EXPLAIN_HEADER) or "").strip().lower() in _EXPLAIN_ON
        if fans_out(req):  # n > 1 or batched prompts: several generations, one response
            return await fanout.serve(
                self, scope, send, req, model, request_id, start, watch, lambda freq: _route_headers(freq, explain)
            )
        try:
            try:
                gen, pre, plan, freq = await self._start(scope, req, model, request_id, start)
                first = await gen.__anext__()
                fmt = self.formatter(req, request_id, int(time.time()), plan)
                collector = LogprobCollector(pre) if plan.logprobs is not None else None
            except Exception as exc:  # noqa: BLE001 - nothing sent yet: a proper HTTP error
                watch.done()
                await send_error(send, to_http_error(exc, request_id=request_id))
                return STATUS_ERROR
            mm = freq.model.metrics
            now = time.perf_counter()
            mm.ttft.observe(now - start)
            mm.isl.observe(gen.prompt_tokens)
            if req.stream:
                status = await self._stream(send, req, gen, first, fmt, collector, plan, _route_headers(freq, explain), now, watch)
            else:
                status = await self._unary(send, gen, first, fmt, collector, plan, watch, freq, explain)
            if status == STATUS_SUCCESS:
                mm.osl.observe(gen.completion_tokens)
                mm.usage(gen.prompt_tokens, gen.cached_tokens)
                worker_id = freq.worker_id
                if worker_id is not None:
                    self.state.metrics.worker_latency(worker_id, now - start, time.perf_counter() - now, gen.completion_tokens,
                                                      freq.disagg)
            return status
        finally:
            if gen is not None:
                await gen.aclose()

    async def _start(
        self, scope: Scope, req: Any, model: ServedModel, request_id: str, start: float
    ) -> tuple[TextGeneration, ModelPreprocessor, _Plan, FrontendRequest]:
        """Preprocesses the request and opens its engine stream (not yet awaited)."""
        pre = await model.preprocessor()
        plan = await self.plan(req, model, pre)
        sampling = sampling_options(req, logprobs=plan.logprobs, vocab_size=pre.vocab_size)
        gen, freq = self.open_generation(scope, req, model, pre, plan, request_id, start, sampling)
        return gen, pre, plan, freq

    def open_generation(
        self,
        scope: Scope,
        req: Any,
        model: ServedModel,
        pre: ModelPreprocessor,
        plan: _Plan,
        request_id: str,
        start: float,
        sampling: SamplingOptions,
    ) -> tuple[TextGeneration, FrontendRequest]:
        """Routes one generation of ``plan`` and opens its engine stream (not yet awaited); each
        choice of a fan-out request is one such generation, with its own id and seed."""
        direct = header(scope, WORKER_HEADER)
        direct_ids = header_candidates(direct) if direct else None
        preq = PreprocessedRequest(
            request_id=request_id,
            model=model.card.base_model or model.name,
            token_ids=plan.prompt_ids,
            sampling=sampling,
            stop=StopConditions(
                max_tokens=plan.max_tokens,
                min_tokens=req.min_tokens,
                stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.wants_ignore_eos,
            ),
            lora_name=model.lora_name,
            router=req.nvext.sla_targets() if req.nvext is not None else None,
            routing=req.nvext.routing_hints() if req.nvext is not None else None,
        )
        freq = FrontendRequest(
            request_id=request_id, model=model, preprocessed=preq, started_at=start, direct_ids=direct_ids,
            migration_limit=model.card.migration_limit,
        )
        engine = self.state.dispatcher.open(freq)
        markers = plan.parser.markers if plan.parser is not None else ()
        detokenizer = pre.detokenizer(plan.prompt_ids, markers)
        gen = TextGeneration(engine, detokenizer, plan.stops, want_logprobs=plan.logprobs is not None)
        return gen, freq

    async def fanout_plans(self, req: Any, model: ServedModel, pre: ModelPreprocessor) -> list[_Plan]:
        """One plan per prompt of a fan-out request (chat has one prompt)."""
        return [await self.plan(req, model, pre)]

    def sibling_plan(self, req: Any, model: ServedModel, plan: _Plan) -> _Plan:
        """``plan`` for another choice of the same prompt: the same prompt and budget, with an
        output parser of its own (parsers keep per-reply state)."""
        return plan

    async def _stream(
        self,
        send: Any,
        req: Any,
        gen: TextGeneration,
        first: Delta,
        fmt: ChatFormatter | CompletionFormatter,
        collector: LogprobCollector | None,
        plan: _Plan,
        route_headers: list[tuple[bytes, bytes]],
        first_at: float,
        watch: DisconnectWatch,
    ) -> str:
        await send({"type": "http.response.start", "status": 200, "headers": [*_SSE_HEADERS, *route_headers]})
        continuous = req.continuous_usage
        itl = gen.engine.request.model.metrics.itl
        # Coalescing would have to merge log-probabilities across chunks; with them, send each delta.
        coalesce_s = self.state.config.coalesce_s if collector is None else 0.0
        delta = first
        text = plan.echo_text + first.text
        last_sent = first_at
        return_tokens = req.return_token_ids
        pending_tokens: list[int] = []
        chunk_tokens: list[int] | None = None
        # Chunks whose successor has already arrived from the worker wait for it and leave in one
        # write: a client that falls behind gets several tokens per send, never later than before.
        held: list[bytes] = []
        gen.yield_idle = True
        try:
            while True:
                finish = delta.finish_reason
                now = time.perf_counter()
                if finish is None and coalesce_s and now - last_sent < coalesce_s and delta is not first:
                    pending_text = text
                    if return_tokens:
                        pending_tokens = pending_tokens + delta.token_ids
                else:
                    usage = make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens) if continuous else None
                    if return_tokens:
                        chunk_tokens = pending_tokens + delta.token_ids if pending_tokens else delta.token_ids
                    chunk = fmt.chunk(text, finish, self._logprobs(collector, delta), usage, chunk_tokens)
                    pending_text = ""
                    pending_tokens = []
                    if finish is not None:
                        if delta is not first:
                            itl.observe(now - last_sent)
                        tail = [*held, chunk]
                        if req.include_usage:
                            tail.append(fmt.usage_chunk(make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)))
                        tail.append(SSE_DONE)
                        watch.done()
                        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})
                        return STATUS_SUCCESS
                    if chunk:  # empty: an output parser holds the text back (it may be markup)
                        if delta is not first:
                            itl.observe(now - last_sent)
                        last_sent = now
                        held.append(chunk)
                if held and not gen.ready:
                    body = held[0] if len(held) == 1 else b"".join(held)
                    held.clear()
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                delta = await gen.__anext__()
                while delta is IDLE:  # no text yet and nothing more arrived: what is held goes now
                    if held:
                        body = b"".join(held)
                        held.clear()
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    delta = await gen.__anext__()
                text = pending_text + delta.text
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - headers are out: report in-band, then end the stream
            error = to_http_error(exc, request_id=fmt.id)
            logger.warning("stream failed after start request_id=%s status=%d error=%s", fmt.id, error.status, exc)
            watch.done()
            payload = b"".join(held) + b"data: " + sse_safe(error.body) + b"\n\n" + SSE_DONE
            await send({"type": "http.response.body", "body": payload, "more_body": False})
            return STATUS_ERROR

    async def _unary(
        self,
        send: Any,
        gen: TextGeneration,
        first: Delta,
        fmt: ChatFormatter | CompletionFormatter,
        collector: LogprobCollector | None,
        plan: _Plan,
        watch: DisconnectWatch,
        freq: FrontendRequest,
        explain: bool,
    ) -> str:
        parts = [plan.echo_text, first.text]
        delta = first
        self._logprobs(collector, first)
        try:
            while delta.finish_reason is None:
                delta = await gen.__anext__()
                parts.append(delta.text)
                self._logprobs(collector, delta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            watch.done()
            await send_error(send, to_http_error(exc, request_id=fmt.id))
            return STATUS_ERROR
        usage = make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
        body = fmt.response(
            "".join(parts), delta.finish_reason, self._total_logprobs(collector), usage, gen.engine.generated[: gen.completion_tokens]
        )
        watch.done()
        await send_json(send, 200, body, _route_headers(freq, explain))
        return STATUS_SUCCESS


def chat_output_parser(req: ChatCompletionRequest, model: ServedModel) -> OutputParser | None:
    """The request's output parser from the model card's parser names and the request's tool
    settings (checked here, so a bad ``tool_choice`` is a 400 before anything is routed); None
    when nothing needs parsing. ``tool_choice: none`` turns tool-call parsing off; ``required`` or
    a named function reads the reply, constrained to JSON by ``sampling.py``, as the calls."""
    card = model.card
    tools = ToolSettings.from_request(req.tools, req.tool_choice, req.parallel_tool_calls) if req.tools or req.tool_choice else None
    if forces_call(tools):
        assert tools is not None
        return forced_output_parser(tools)
    if card.tool_call_parser is None and card.reasoning_parser is None:
        return None
    return build_output_parser(
        tool_call_parser_name=card.tool_call_parser, reasoning_parser_name=card.reasoning_parser, tools=tools
    )


class ChatCompletionsEndpoint(OpenAIEndpoint):
    endpoint_name = ENDPOINT_CHAT

    def decode(self, body: bytes) -> ChatCompletionRequest:
        return decode_chat_request(body)

    async def plan(self, req: ChatCompletionRequest, model: ServedModel, pre: ModelPreprocessor) -> _Plan:
        stops = req.stop_list()
        prompt_ids = await pre.chat_prompt(req)
        max_tokens = plan_max_tokens(len(prompt_ids), req.output_limit(), model.context_length, None)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return _Plan(prompt_ids, max_tokens, logprobs, "", stops, chat_output_parser(req, model))

    def sibling_plan(self, req: ChatCompletionRequest, model: ServedModel, plan: _Plan) -> _Plan:
        if plan.parser is None:
            return plan
        return _Plan(plan.prompt_ids, plan.max_tokens, plan.logprobs, plan.echo_text, plan.stops, chat_output_parser(req, model))

    def formatter(self, req: ChatCompletionRequest, response_id: str, created: int, plan: _Plan) -> ChatFormatter:
        return ChatFormatter(
            response_id, created, req.model, include_usage=req.include_usage, continuous_usage=req.continuous_usage,
            return_token_ids=req.return_token_ids, parser=plan.parser,
        )

    def _logprobs(self, collector: LogprobCollector | None, delta: Delta) -> Any:
        if collector is None:
            return None
        return collector.add_chat(delta.token_ids, delta.log_probs, delta.top_logprobs)

    def _total_logprobs(self, collector: LogprobCollector | None) -> Any:
        return collector.chat_total() if collector is not None else None


class CompletionsEndpoint(OpenAIEndpoint):
    endpoint_name = ENDPOINT_COMPLETIONS

    def decode(self, body: bytes) -> CompletionRequest:
        return decode_completion_request(body)

    async def plan(self, req: CompletionRequest, model: ServedModel, pre: ModelPreprocessor) -> _Plan:
        self._check(req)
        prompts = completion_prompts(req)
        if len(prompts) != 1:  # fanout.fans_out sends batches elsewhere; a guard, not a path
            raise InvalidRequestError(f"expected one prompt, got {len(prompts)}", param="prompt")
        return await self._plan_prompt(req, model, pre, prompts[0])

    async def fanout_plans(self, req: CompletionRequest, model: ServedModel, pre: ModelPreprocessor) -> list[_Plan]:
        self._check(req)
        return [await self._plan_prompt(req, model, pre, prompt) for prompt in completion_prompts(req)]

    @staticmethod
    def _check(req: CompletionRequest) -> None:
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError(
                f"best_of={req.best_of} with n={req.n} is not supported: candidates are not ranked here; "
                "leave best_of unset or equal to n",
                param="best_of",
            )
        if req.suffix:
            raise InvalidRequestError("suffix is not supported by this model", param="suffix")

    async def _plan_prompt(
        self, req: CompletionRequest, model: ServedModel, pre: ModelPreprocessor, prompt: str | list[int]
    ) -> _Plan:
        stops = req.stop_list()
        prompt_ids = await pre.completion_prompt(prompt)
        try:
            max_tokens = plan_max_tokens(len(prompt_ids), req.max_tokens, model.context_length, DEFAULT_COMPLETION_MAX_TOKENS)
        except ContextLengthError as exc:
            if exc.param == "messages":
                exc.param = "prompt"
            raise
        echo = ""
        if req.echo:
            echo = prompt if isinstance(prompt, str) else pre.tokenizer.decode(prompt, skip_special_tokens=False)
        return _Plan(prompt_ids, max_tokens, req.logprobs, echo, stops)

    def formatter(self, req: CompletionRequest, response_id: str, created: int, plan: _Plan) -> CompletionFormatter:
        return CompletionFormatter(
            response_id, created, req.model, include_usage=req.include_usage, continuous_usage=req.continuous_usage,
            return_token_ids=req.return_token_ids,
        )

    def _logprobs(self, collector: LogprobCollector | None, delta: Delta) -> Any:
        if collector is None:
            return None
        return collector.add_completion(delta.token_ids, delta.log_probs, delta.top_logprobs)

    def _total_logprobs(self, collector: LogprobCollector | None) -> Any:
        return collector.completion_total() if collector is not None else None
