"""``n > 1`` and batched prompts: one HTTP request, several generations, one response.

Each choice is a generation of its own (its own request id, so the engines and the router see
independent requests; KV routing sends siblings of one prompt to the same worker, which is right:
they share the prompt's blocks). Choice ``index`` is ``prompt_index * n + i``. With a ``seed``,
sample ``i`` uses ``seed + i`` so the siblings differ yet stay reproducible.

Like the single-choice path, everything up to every choice's first token can still fail with an
HTTP status. After that, choices stream interleaved, each chunk naming its choice ``index``; a
failing choice cancels its siblings and ends the stream with an error event (or the unary
request with an error body): never a silently short answer. A client that hangs up cancels the
request's task, and every sibling's engine request is closed on the way out.

Usage counts each prompt once (the first choice of each prompt) and every choice's completion
tokens, as OpenAI does.

A plain ``n=1`` single-prompt request never comes here (``fans_out`` is the endpoint's only cost).

What one request may start is bounded (``check_fanout``, before any prompt is tokenized): prompts
x ``n`` at most ``--max-prompts-per-request``; the whole product counts against ``--max-inflight``
(a 100-choice request holds 100 of its slots) and, with ``--rate-limit``, takes that many tokens
from the caller's bucket (the doors took one before the body was read). Without this one small
body with 50,000 prompts started 50,000 generations and starved every other client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import msgspec

from dynamod.daemon.frontend.http.asgi import SSE_HEADERS, DisconnectWatch, Scope, send_error, send_json
from dynamod.daemon.frontend.http.errors import to_http_error
from dynamod.daemon.frontend.http.limits import RATE_LIMIT_SCOPE_KEY, rate_limited_error
from dynamod.daemon.frontend.openai.formatters import SSE_DONE, LogprobCollector, make_usage, sse_safe
from dynamod.daemon.frontend.openai.sampling import sampling_options
from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest, CompletionRequest, UsageInfo, encoder
from dynamod.daemon.frontend.openai.writers import OpenAIFormat, logprob_collector
from dynamod.daemon.frontend.pipeline.generation import Delta, TextGeneration
from dynamod.daemon.frontend.pipeline.metrics import STATUS_ERROR, STATUS_SUCCESS
from dynamod.daemon.frontend.pipeline.models import ServedModel
from dynamod.daemon.frontend.pipeline.request import EngineRequest, FrontendRequest, Plan
from dynamod.daemon.frontend.pipeline.state import FrontendState
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.shared.errors import EngineError, InvalidRequestError
from dynamod.shared.protocol.llm import SamplingOptions

logger = logging.getLogger(__name__)

OpenAIRequest = ChatCompletionRequest | CompletionRequest
_U64 = 2**64
_I64 = 2**63
_QUEUE_PER_CHOICE = 8  # chunks a choice may be ahead of the socket before it waits


DEFAULT_MAX_PROMPTS_PER_REQUEST = 128
"""OpenAI's own cap on ``n``; batches of more prompts are split by the client at little cost."""


def fanout_cost(req: OpenAIRequest) -> int:
    """The generations a request starts: its prompts (a completions batch) times ``n``."""
    prompt = getattr(req, "prompt", None)
    prompts = len(prompt) if type(prompt) is list and prompt and type(prompt[0]) is not int else 1
    return prompts * max(1, req.n or 1)


def check_fanout(scope: Scope, req: OpenAIRequest, state: FrontendState) -> int:
    """Caps, rate-charges and admits a decoded request; returns its cost (prompts x ``n``).
    Raises the error the client gets: 400 over the cap, 429 out of rate, 503 at ``--max-inflight``."""
    cost = fanout_cost(req)
    limit = state.config.max_prompts_per_request
    if cost > limit:
        n = max(1, req.n or 1)
        prompts = cost // n
        raise InvalidRequestError(
            f"this request asks for {prompts} prompt(s) x n={n} = {cost} generations; this server allows at most "
            f"{limit} per request (--max-prompts-per-request): split the batch",
            param="n" if prompts == 1 else "prompt",
        )
    charged = scope.get(RATE_LIMIT_SCOPE_KEY)
    if charged is not None and cost > 1:
        limiter, client = charged
        wait = limiter.acquire(client, cost=cost - 1)  # the doors took the first token
        if wait > 0.0:
            raise rate_limited_error(limiter, wait, cost)
    refusal = state.admission_refusal(cost)
    if refusal is not None:
        raise refusal[1]
    return cost


def fans_out(req: OpenAIRequest) -> bool:
    """True for a request with several choices: ``n > 1`` or a batch of completion prompts."""
    if req.n != 1:
        return True
    prompt = getattr(req, "prompt", None)  # completions only
    return type(prompt) is list and len(prompt) > 1 and type(prompt[0]) is not int


def sibling_seed(seed: int | None, i: int) -> int | None:
    """The seed of sample ``i`` of a prompt: ``seed + i``, kept in the signed 64-bit range."""
    if seed is None or i == 0:
        return seed
    return (seed + i + _I64) % _U64 - _I64


class FanoutSurface(OpenAIFormat, Protocol):
    """What the fan-out needs from the chat or the completions endpoint: its plans and format,
    and the pipeline's way to open one generation."""

    state: FrontendState

    async def fanout_plans(self, req: Any, model: ServedModel, pre: ModelPreprocessor) -> list[Plan]: ...

    def sibling_plan(self, req: Any, model: ServedModel, plan: Plan) -> Plan: ...

    def open_generation(
        self, request: FrontendRequest[Any], plan: Plan, request_id: str, sampling: SamplingOptions | None = None
    ) -> TextGeneration: ...


class _Choice:
    """One generation of the fan-out and what formats it."""

    __slots__ = ("index", "first_of_prompt", "gen", "fmt", "plan", "engine", "collector", "first")

    def __init__(self, index: int, first_of_prompt: bool, gen: TextGeneration, fmt: Any, plan: Plan,
                 collector: LogprobCollector | None) -> None:
        self.index = index
        self.first_of_prompt = first_of_prompt
        self.gen = gen
        self.fmt = fmt
        self.plan = plan
        self.engine: EngineRequest = gen.request
        self.collector = collector
        self.first: Delta | None = None


class _ResponseParts(msgspec.Struct):
    """The parts of one formatted single-choice response that the merged response reuses; the
    choice stays encoded (its struct type depends on the endpoint and options)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[msgspec.Raw]


class _MergedResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[msgspec.Raw]
    usage: UsageInfo
    system_fingerprint: str | None = None


_parts_decoder = msgspec.json.Decoder(_ResponseParts)


def total_usage(choices: list[_Choice]) -> UsageInfo:
    """Each prompt once, every choice's completion tokens."""
    prompt = cached = completion = 0
    for c in choices:
        gen = c.gen
        completion += gen.completion_tokens
        if c.first_of_prompt:
            prompt += gen.prompt_tokens
            cached += gen.cached_tokens
    return make_usage(prompt, completion, cached)


async def serve(request: FrontendRequest[OpenAIRequest], endpoint: FanoutSurface) -> str:
    """Serves an admitted fan-out request (``fans_out(request.body)``); returns its metrics status.
    ``endpoint`` is the chat or completions endpoint whose plan, open and format steps each choice
    reuses."""
    choices: list[_Choice] = []
    send = request.send
    watch = request.watch
    start = request.started_at
    try:
        try:
            await _open_all(endpoint, request, choices)
            await _first_deltas(choices)
        except Exception as exc:  # noqa: BLE001 - nothing sent yet: a proper HTTP error
            watch.done()
            await send_error(send, to_http_error(exc, request_id=request.request_id))
            return STATUS_ERROR
        mm = request.model.metrics
        now = time.perf_counter()
        mm.observe_ttft(now - start, choices[0].engine.preprocessed.priority)
        for c in choices:
            if c.first_of_prompt:
                mm.isl.observe(c.gen.prompt_tokens)
        headers = request.route_headers(choices[0].engine)
        if request.stream:
            status = await _stream(endpoint, request, choices, headers)
        else:
            status = await _unary(endpoint, request, choices, headers)
        if status == STATUS_SUCCESS:
            done_at = time.perf_counter()
            for c in choices:
                gen = c.gen
                mm.osl.observe(gen.completion_tokens)
                if c.first_of_prompt:
                    mm.usage(gen.prompt_tokens, gen.cached_tokens)
                worker_id = c.engine.worker_id
                if worker_id is not None:
                    endpoint.state.metrics.worker_latency(worker_id, now - start, done_at - now, gen.completion_tokens,
                                                          c.engine.disagg)
        return status
    finally:
        # Every sibling's engine request ends here, whichever way out (end, error, hang-up).
        await asyncio.gather(*(c.gen.aclose() for c in choices), return_exceptions=True)


async def _open_all(endpoint: FanoutSurface, request: FrontendRequest[OpenAIRequest], out: list[_Choice]) -> None:
    """Plans every prompt and opens every choice's engine stream (appended to ``out`` as it goes,
    so the caller closes what was opened even when a later one fails)."""
    req = request.body
    model = request.model
    pre = request.preprocessor = await model.preprocessor()
    plans = await endpoint.fanout_plans(req, model, pre)
    base = sampling_options(req, logprobs=plans[0].logprobs, vocab_size=pre.vocab_size)  # one grammar compile
    created = int(time.time())
    n = req.n
    for p, prompt_plan in enumerate(plans):
        prompt_plan.sampling = base
        for i in range(n):
            index = p * n + i
            plan = prompt_plan if i == 0 else endpoint.sibling_plan(req, model, prompt_plan)
            sampling = base if i == 0 else msgspec.structs.replace(base, seed=sibling_seed(req.seed, i))
            gen = endpoint.open_generation(request, plan, f"{request.request_id}-{index}", sampling)
            fmt = endpoint.formatter(req, request.request_id, created, plan)
            fmt.index = index
            out.append(_Choice(index, i == 0, gen, fmt, plan, logprob_collector(request, plan)))


async def _next_delta(gen: TextGeneration) -> Delta:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise EngineError("the engine stream ended without a finish reason") from None


async def _first_deltas(choices: list[_Choice]) -> None:
    """Every choice's first delta, awaited together; the first failure cancels the rest."""
    tasks = [asyncio.create_task(_next_delta(c.gen)) for c in choices]
    try:
        await _all_or_first_error(tasks)
    finally:
        await _cancel(tasks)
    for c, task in zip(choices, tasks, strict=True):
        c.first = task.result()


async def _all_or_first_error(tasks: list[asyncio.Task[Any]]) -> None:
    done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in tasks:  # in choice order, so the error reported does not depend on timing
        if task in done and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancels and awaits the tasks still running; a sibling's failure after the first is read
    here, so it is not reported again as never retrieved."""
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


# -- unary ----------------------------------------------------------------------------------------


async def _drain(endpoint: FanoutSurface, c: _Choice) -> bytes:
    """Reads one choice to its end; returns its formatted single-choice response."""
    delta = c.first
    assert delta is not None
    parts = [c.plan.echo_text, delta.text]
    endpoint.chunk_logprobs(c.collector, delta)
    while delta.finish_reason is None:
        delta = await _next_delta(c.gen)
        parts.append(delta.text)
        endpoint.chunk_logprobs(c.collector, delta)
    gen = c.gen
    usage = make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
    return c.fmt.response(
        "".join(parts), delta.finish_reason, endpoint.total_logprobs(c.collector), usage, gen.token_ids,
    )


async def _unary(
    endpoint: FanoutSurface, request: FrontendRequest[OpenAIRequest], choices: list[_Choice], headers: list[tuple[bytes, bytes]]
) -> str:
    send = request.send
    watch = request.watch
    tasks = [asyncio.create_task(_drain(endpoint, c)) for c in choices]
    try:
        await _all_or_first_error(tasks)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - one failed choice fails the request
        watch.done()
        await send_error(send, to_http_error(exc, request_id=choices[0].fmt.id))
        return STATUS_ERROR
    finally:
        await _cancel(tasks)
    parts = [_parts_decoder.decode(t.result()) for t in tasks]
    head = parts[0]
    merged = _MergedResponse(
        id=head.id, object=head.object, created=head.created, model=head.model,
        choices=[p.choices[0] for p in parts], usage=total_usage(choices),
    )
    watch.done()
    await send_json(send, 200, encoder.encode(merged), headers)
    return STATUS_SUCCESS


# -- streaming ------------------------------------------------------------------------------------


async def _produce(
    endpoint: FanoutSurface, req: OpenAIRequest, c: _Choice, queue: asyncio.Queue[tuple[_Choice, bytes | None]]
) -> None:
    """Formats one choice's deltas into SSE chunks for the shared queue; ``None`` marks its end.
    An exception propagates (the consumer sees the task fail)."""
    delta = c.first
    assert delta is not None
    text = c.plan.echo_text + delta.text
    fmt = c.fmt
    gen = c.gen
    continuous = req.continuous_usage
    return_tokens = req.return_token_ids
    while True:
        usage = make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens) if continuous else None
        chunk = fmt.chunk(
            text, delta.finish_reason, endpoint.chunk_logprobs(c.collector, delta), usage,
            delta.token_ids if return_tokens else None,
        )
        if chunk:  # empty: an output parser holds the text back (it may be markup)
            await queue.put((c, chunk))
        if delta.finish_reason is not None:
            await queue.put((c, None))
            return
        delta = await _next_delta(gen)
        text = delta.text


async def _stream(
    endpoint: FanoutSurface, request: FrontendRequest[OpenAIRequest], choices: list[_Choice], headers: list[tuple[bytes, bytes]]
) -> str:
    send = request.send
    watch = request.watch
    req = request.body
    await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *headers]})
    queue: asyncio.Queue[tuple[_Choice, bytes | None]] = asyncio.Queue(maxsize=_QUEUE_PER_CHOICE * len(choices))
    tasks = [asyncio.create_task(_produce(endpoint, req, c, queue)) for c in choices]
    failed = asyncio.Event()
    for task in tasks:
        task.add_done_callback(lambda t: failed.set() if not t.cancelled() and t.exception() is not None else None)
    fmt = choices[0].fmt
    running = len(choices)
    body: list[bytes] = []
    try:
        while running:
            item = await _next_item(queue, failed)
            if item is None:  # a choice failed: its error, after what the others already sent
                exc = next(t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception())
                return await _stream_error(send, exc, fmt.id, watch)
            body: list[bytes] = []
            while item is not None:  # everything already waiting leaves in one write
                _choice, chunk = item
                if chunk is None:
                    running -= 1
                else:
                    body.append(chunk)
                item = queue.get_nowait() if not queue.empty() else None
            if running and body:
                await send({"type": "http.response.body", "body": b"".join(body), "more_body": True})
        if req.include_usage:
            body.append(fmt.usage_chunk(total_usage(choices)))
        body.append(SSE_DONE)
        watch.done()
        await send({"type": "http.response.body", "body": b"".join(body), "more_body": False})
        return STATUS_SUCCESS
    finally:
        await _cancel(tasks)


async def _next_item(
    queue: asyncio.Queue[tuple[_Choice, bytes | None]], failed: asyncio.Event
) -> tuple[_Choice, bytes | None] | None:
    """The next queued chunk, or None once a producer has failed (its siblings' chunks still
    queued are dropped: the stream ends with the error either way)."""
    if failed.is_set():
        return None
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    waiter = asyncio.ensure_future(failed.wait())
    try:
        await asyncio.wait([getter, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    return None


async def _stream_error(send: Any, exc: BaseException, response_id: str, watch: DisconnectWatch) -> str:
    error = to_http_error(exc, request_id=response_id)
    logger.warning("fan-out stream failed after start request_id=%s status=%d error=%s", response_id, error.status, exc)
    watch.done()
    await send({"type": "http.response.body", "body": b"data: " + sse_safe(error.body) + b"\n\n" + SSE_DONE, "more_body": False})
    return STATUS_ERROR
