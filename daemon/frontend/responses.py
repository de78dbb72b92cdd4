"""``POST /v1/responses`` (OpenAI's Responses API) on the chat pipeline, and the stored responses.

    body -> ResponsesRequest -> (+ history of previous_response_id) -> ResponsesChatRequest
         -> the chat pipeline (template, tokens, route, migrate, detokenize)
         -> OutputSplitter (text / reasoning / function calls) -> ResponseBuilder
         -> one response object, or the Responses event stream

``ResponsesEndpoint`` is the chat endpoint with another way in and another way out: ``decode``
turns the request into a chat request (``responses_protocol.py``), the chat ``plan`` and the shared
``_start`` run unchanged, and ``_serve`` writes Responses objects and events instead of chat
chunks. As on chat, everything up to the first generated token fails with an HTTP status; after
the stream began, a failure is an ``error`` event followed by ``response.failed``.

A finished response with ``store`` on (the default) is kept in the frontend's bounded
``ResponseStore``, which makes ``previous_response_id`` work and serves
``GET``/``DELETE /v1/responses/{id}``.

Reasoning and function calls come from the same parsers as chat's: the chat ``plan`` builds the
request's ``OutputParser`` (model card parser names, the request's tools and ``tool_choice``), and
``ResponsesEndpoint.splitter`` turns its deltas into pieces that ``ResponseBuilder`` makes into
``reasoning`` and ``function_call`` items and events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import msgspec

from dynamod.daemon.frontend.asgi import DisconnectWatch, Scope, header, send_error, send_json
from dynamod.daemon.frontend.endpoints import (
    _EXPLAIN_ON,
    ChatCompletionsEndpoint,
    _route_headers,
)
from dynamod.daemon.frontend.errors import to_http_error
from dynamod.daemon.frontend.generation import Delta, TextGeneration
from dynamod.daemon.frontend.metrics import STATUS_ERROR, STATUS_SUCCESS
from dynamod.daemon.frontend.models import ServedModel
from dynamod.daemon.frontend.request import EXPLAIN_HEADER, FrontendRequest
from dynamod.daemon.frontend.responses_output import (
    STATUS_COMPLETED,
    STATUS_INCOMPLETE,
    OutputSplitter,
    ResponseBuilder,
    make_usage,
    output_splitter,
)
from dynamod.daemon.frontend.responses_protocol import (
    ResponsesChatRequest,
    ResponsesRequest,
    decode_responses_request,
    to_chat_request,
)
from dynamod.daemon.frontend.responses_store import ResponseStore, StoredResponse
from dynamod.daemon.frontend.state import FrontendState
from dynamod.shared.protocol.llm import FINISH_LENGTH

logger = logging.getLogger(__name__)

ENDPOINT_RESPONSES = "responses"  # the metrics' endpoint label, as Dynamo names it
RESPONSE_ID_PREFIX = "resp_"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def echo_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the response object repeats them."""
    return {
        "model": req.model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "store": req.store,
        "text": {"format": msgspec.to_builtins(req.text.format) if req.text is not None and req.text.format else {"type": "text"}},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "truncation": "disabled",
        "metadata": req.metadata or {},
        "user": req.user,
    }


def _final_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(response status, incomplete reason) for the engine's finish reason."""
    if finish_reason == FINISH_LENGTH:
        return STATUS_INCOMPLETE, "max_output_tokens"
    return STATUS_COMPLETED, None


class ResponsesEndpoint(ChatCompletionsEndpoint):
    endpoint_name = ENDPOINT_RESPONSES

    def __init__(self, state: FrontendState, store: ResponseStore) -> None:
        super().__init__(state)
        self.store = store

    def decode(self, body: bytes) -> ResponsesChatRequest:
        req = decode_responses_request(body)
        history = self.store.history(req.previous_response_id) if req.previous_response_id else []
        return to_chat_request(req, history)

    def splitter(self, plan: Any) -> OutputSplitter:
        """How this request's generated text divides into answer, reasoning and function calls:
        by the output parser its chat plan built (``plan.parser``; None: all answer text)."""
        return output_splitter(getattr(plan, "parser", None))

    async def _serve(
        self, scope: Scope, send: Any, req: Any, model: ServedModel, request_id: str, start: float, watch: DisconnectWatch
    ) -> str:
        assert isinstance(req, ResponsesChatRequest) and req.responses is not None
        gen: TextGeneration | None = None
        explain = (header(scope, EXPLAIN_HEADER) or "").strip().lower() in _EXPLAIN_ON
        try:
            try:
                gen, _pre, plan, freq = await self._start(scope, req, model, request_id, start)
                first = await gen.__anext__()
            except Exception as exc:  # noqa: BLE001 - nothing sent yet: a proper HTTP error
                watch.done()
                await send_error(send, to_http_error(exc, request_id=request_id))
                return STATUS_ERROR
            mm = freq.model.metrics
            now = time.perf_counter()
            mm.ttft.observe(now - start)
            mm.isl.observe(gen.prompt_tokens)
            builder = ResponseBuilder(
                RESPONSE_ID_PREFIX + request_id, int(time.time()), echo_fields(req.responses), emit=bool(req.stream)
            )
            splitter = self.splitter(plan)
            route_headers = _route_headers(freq, explain)
            if req.stream:
                final = await self._stream_events(send, gen, first, builder, splitter, route_headers, now, watch, freq)
            else:
                final = await self._respond(send, gen, first, builder, splitter, route_headers, watch)
            if final is None:
                return STATUS_ERROR
            mm.osl.observe(gen.completion_tokens)
            mm.usage(gen.prompt_tokens, gen.cached_tokens)
            if freq.worker_id is not None:
                self.state.metrics.worker_latency(freq.worker_id, now - start, time.perf_counter() - now, gen.completion_tokens,
                                                  freq.disagg)
            if req.responses.store:
                self.store.put(
                    builder.id,
                    StoredResponse(final, req.turn_messages + builder.output_messages(), req.responses.previous_response_id),
                )
            return STATUS_SUCCESS
        finally:
            if gen is not None:
                await gen.aclose()

    @staticmethod
    def _finish(builder: ResponseBuilder, gen: TextGeneration, finish_reason: str | None) -> tuple[str, str | None, dict[str, Any]]:
        status, reason = _final_status(finish_reason)
        return status, reason, make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)

    async def _respond(
        self,
        send: Any,
        gen: TextGeneration,
        first: Delta,
        builder: ResponseBuilder,
        splitter: OutputSplitter,
        route_headers: list[tuple[bytes, bytes]],
        watch: DisconnectWatch,
    ) -> dict[str, Any] | None:
        """The unary response; returns the response object, or None after sending an error."""
        delta = first
        try:
            builder.add(splitter.feed(delta.text))
            while delta.finish_reason is None:
                delta = await gen.__anext__()
                builder.add(splitter.feed(delta.text))
            builder.add(splitter.finish())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            watch.done()
            await send_error(send, to_http_error(exc, request_id=builder.id))
            return None
        status, reason, usage = self._finish(builder, gen, delta.finish_reason)
        builder.finish(status, usage, incomplete_reason=reason)  # closes the items
        final = builder.response(status, usage, incomplete_reason=reason, completed_at=int(time.time()))
        watch.done()
        await send_json(send, 200, msgspec.json.encode(final), route_headers)
        return final

    async def _stream_events(
        self,
        send: Any,
        gen: TextGeneration,
        first: Delta,
        builder: ResponseBuilder,
        splitter: OutputSplitter,
        route_headers: list[tuple[bytes, bytes]],
        first_at: float,
        watch: DisconnectWatch,
        freq: FrontendRequest,
    ) -> dict[str, Any] | None:
        """The event stream; returns the final response object, or None after a failure event."""
        await send({"type": "http.response.start", "status": 200, "headers": [*_SSE_HEADERS, *route_headers]})
        itl = freq.model.metrics.itl
        last = first_at
        delta = first
        try:
            body = builder.start() + builder.add(splitter.feed(first.text))
            while delta.finish_reason is None:
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                delta = await gen.__anext__()
                now = time.perf_counter()
                itl.observe(now - last)
                last = now
                body = builder.add(splitter.feed(delta.text))
            body += builder.add(splitter.finish())
            status, reason, usage = self._finish(builder, gen, delta.finish_reason)
            body += builder.finish(status, usage, incomplete_reason=reason)
            final = builder.response(status, usage, incomplete_reason=reason, completed_at=int(time.time()))
            watch.done()
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return final
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - headers are out: report in-band, then end the stream
            error = to_http_error(exc, request_id=builder.id)
            detail = json.loads(error.body)["error"]
            logger.warning("response stream failed request_id=%s status=%d error=%s", builder.id, error.status, exc)
            watch.done()
            await send({"type": "http.response.body", "body": builder.fail(str(detail["code"]), detail["message"]), "more_body": False})
            return None


class StoredResponsesEndpoint:
    """``GET /v1/responses/{id}`` returns a stored response; ``DELETE`` forgets it."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        response_id = scope.get("path_params", {}).get("response_id", "")
        try:
            if scope["method"] == "DELETE":
                self.store.delete(response_id)
                body = {"id": response_id, "object": "response", "deleted": True}
            else:
                body = self.store.get(response_id).response
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            await send_error(send, to_http_error(exc))
            return
        await send_json(send, 200, msgspec.json.encode(body))

