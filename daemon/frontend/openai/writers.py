"""The two output formats of ``/v1/chat/completions`` and ``/v1/completions``: an SSE stream of
chunks, or one JSON body.

Both read the endpoint's format (``OpenAIFormat``: the chunk formatter and how log-probabilities
are shown, which differ between chat and completions) and the request's plan (echoed text, log
probabilities asked for). Once headers are out a failure is reported in-band: an SSE ``error``
event, which the official client raises as ``APIError``, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from dynamod.daemon.frontend.http.asgi import SSE_HEADERS, send_json
from dynamod.daemon.frontend.http.errors import to_http_error
from dynamod.daemon.frontend.openai.formatters import (
    SSE_DONE,
    ChatFormatter,
    CompletionFormatter,
    LogprobCollector,
    generation_usage,
    sse_safe,
)
from dynamod.daemon.frontend.pipeline.generation import IDLE, Delta, TextGeneration
from dynamod.daemon.frontend.pipeline.request import FrontendRequest, Plan
from dynamod.daemon.frontend.pipeline.serve import ResponseWriter

logger = logging.getLogger(__name__)


class OpenAIFormat(Protocol):
    """What the writers need from the chat or the completions endpoint."""

    def formatter(self, req: Any, response_id: str, created: int, plan: Plan) -> ChatFormatter | CompletionFormatter: ...

    def chunk_logprobs(self, collector: LogprobCollector | None, delta: Delta) -> Any: ...

    def total_logprobs(self, collector: LogprobCollector | None) -> Any: ...


def logprob_collector(request: FrontendRequest[Any], plan: Plan) -> LogprobCollector | None:
    """A collector when the plan asks for log-probabilities (one per choice)."""
    if plan.logprobs is None:
        return None
    assert request.preprocessor is not None
    return LogprobCollector(request.preprocessor)


class _OpenAIWriter(ResponseWriter):
    def __init__(self, request: FrontendRequest[Any], fmt: OpenAIFormat) -> None:
        super().__init__(request)
        self.format = fmt

    def _begin(self) -> tuple[Plan, ChatFormatter | CompletionFormatter, LogprobCollector | None]:
        request = self.request
        plan = request.plan
        assert plan is not None
        fmt = self.format.formatter(request.body, request.request_id, int(time.time()), plan)
        return plan, fmt, logprob_collector(request, plan)


class SseChunkWriter(_OpenAIWriter):
    """``stream: true``: ``chat.completion.chunk`` or ``text_completion`` events, then ``[DONE]``.
    ``coalesce_s`` (``--coalesce-ms``): how long a chunk may wait to leave with the next."""

    def __init__(self, request: FrontendRequest[Any], fmt: OpenAIFormat, coalesce_s: float = 0.0) -> None:
        super().__init__(request, fmt)
        self.coalesce_s = coalesce_s

    async def write(self, gen: TextGeneration, first: Delta) -> bool:
        plan, fmt, collector = self._begin()
        request = self.request
        send = request.send
        req = request.body
        first_at = time.perf_counter()
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *request.route_headers(gen.request)]})
        continuous = req.continuous_usage
        itl = gen.metrics.itl
        chunk_logprobs = self.format.chunk_logprobs
        # Coalescing would have to merge log-probabilities across chunks; with them, send each delta.
        coalesce_s = self.coalesce_s if collector is None else 0.0
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
                    usage = generation_usage(gen) if continuous else None
                    if return_tokens:
                        chunk_tokens = pending_tokens + delta.token_ids if pending_tokens else delta.token_ids
                    chunk = fmt.chunk(text, finish, chunk_logprobs(collector, delta), usage, chunk_tokens)
                    pending_text = ""
                    pending_tokens = []
                    if finish is not None:
                        if delta is not first:
                            itl.observe(now - last_sent)
                        tail = [*held, chunk]
                        if req.include_usage:
                            tail.append(fmt.usage_chunk(generation_usage(gen)))
                        tail.append(SSE_DONE)
                        await self.end_stream(b"".join(tail))
                        return True
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
            await self.end_stream(b"".join(held) + b"data: " + sse_safe(error.body) + b"\n\n" + SSE_DONE)
            return False


class JsonWriter(_OpenAIWriter):
    """``stream: false``: one ``chat.completion`` or ``text_completion`` body."""

    async def write(self, gen: TextGeneration, first: Delta) -> bool:
        plan, fmt, collector = self._begin()
        request = self.request
        chunk_logprobs = self.format.chunk_logprobs
        parts = [plan.echo_text, first.text]
        delta = first
        chunk_logprobs(collector, first)
        try:
            while delta.finish_reason is None:
                delta = await gen.__anext__()
                parts.append(delta.text)
                chunk_logprobs(collector, delta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - nothing sent yet: an error body
            await self.refuse(exc, fmt.id)
            return False
        usage = generation_usage(gen)
        body = fmt.response("".join(parts), delta.finish_reason, self.format.total_logprobs(collector), usage, gen.token_ids)
        request.watch.done()
        await send_json(request.send, 200, body, request.route_headers(gen.request))
        return True

