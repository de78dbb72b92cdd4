"""``POST /v1/responses`` (OpenAI's Responses API) on the chat pipeline, and the stored responses.

    body -> ResponsesRequest -> (+ history of previous_response_id) -> ResponsesChatRequest
         -> the chat pipeline (template, tokens, route, migrate, detokenize)
         -> OutputSplitter (text / reasoning / function calls) -> ResponseBuilder
         -> one response object, or the Responses event stream

``ResponsesEndpoint`` is the chat endpoint with another way in and another way out: ``decode``
turns the request into a chat request (``schema.py``), the chat ``plan``, the pipeline's ``start``
and ``serve`` run unchanged, and its writers (``ResponsesEventWriter``, ``ResponsesJsonWriter``)
write Responses objects and events instead of chat chunks. As on chat, everything up to the first generated token fails with an HTTP status; after
the stream began, a failure is an ``error`` event followed by ``response.failed``.

A finished response with ``store`` on (the default) is kept in the frontend's bounded
``ResponseStore``, which makes ``previous_response_id`` work and serves
``GET``/``DELETE /v1/responses/{id}``.

Reasoning and function calls come from the same parsers as chat's: the chat ``plan`` builds the
request's ``OutputParser`` (model card parser names, the request's tools and ``tool_choice``), and
``output_splitter`` turns its deltas into pieces that ``ResponseBuilder`` makes into
``reasoning`` and ``function_call`` items and events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import msgspec

from dynamod.daemon.frontend.http.asgi import SSE_HEADERS, Scope, send_error, send_json
from dynamod.daemon.frontend.http.errors import to_http_error
from dynamod.daemon.frontend.openai.chat import ChatCompletionsEndpoint
from dynamod.daemon.frontend.openai.responses.output import (
    STATUS_COMPLETED,
    STATUS_INCOMPLETE,
    ResponseBuilder,
    make_usage,
)
from dynamod.daemon.frontend.openai.responses.schema import (
    ResponsesChatRequest,
    ResponsesRequest,
    decode_responses_request,
    to_chat_request,
)
from dynamod.daemon.frontend.openai.responses.store import ResponseStore, StoredResponse
from dynamod.daemon.frontend.pipeline.generation import Delta, TextGeneration
from dynamod.daemon.frontend.pipeline.request import FrontendRequest
from dynamod.daemon.frontend.pipeline.serve import ResponseWriter
from dynamod.daemon.frontend.pipeline.state import FrontendState
from dynamod.shared.protocol.llm import FINISH_LENGTH

logger = logging.getLogger(__name__)

ENDPOINT_RESPONSES = "responses"  # the metrics' endpoint label, as Dynamo names it
RESPONSE_ID_PREFIX = "resp_"


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

    async def respond(self, request: FrontendRequest[Any]) -> str:
        return await self.serve(request, self.writer(request))  # one output per response: no fan-out

    def writer(self, request: FrontendRequest[Any]) -> ResponseWriter:
        if request.stream:
            return ResponsesEventWriter(request, self.store)
        return ResponsesJsonWriter(request, self.store)


class ResponsesWriter(ResponseWriter):
    """Builds the response object from the request's chat plan (its parser splits the text into
    answer, reasoning and function calls) and stores it when the request asked to."""

    def __init__(self, request: FrontendRequest[Any], store: ResponseStore) -> None:
        super().__init__(request)
        req = request.body
        assert isinstance(req, ResponsesChatRequest) and req.responses is not None
        self.req: ResponsesChatRequest = req
        self.store = store
        self.final: dict[str, Any] | None = None
        self.builder = ResponseBuilder(
            RESPONSE_ID_PREFIX + request.request_id, int(time.time()), echo_fields(req.responses), emit=bool(req.stream)
        )

    def _finish(self, gen: TextGeneration, finish_reason: str | None) -> tuple[str, str | None, dict[str, Any]]:
        status, reason = _final_status(finish_reason)
        usage = make_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, pinned_tokens=gen.request.pinned_tokens)
        return status, reason, usage

    def completed(self, gen: TextGeneration) -> None:
        req = self.req
        assert req.responses is not None and self.final is not None
        if req.responses.store:
            self.store.put(
                self.builder.id,
                StoredResponse(self.final, req.turn_messages + self.builder.output_messages(), req.responses.previous_response_id),
            )


class ResponsesJsonWriter(ResponsesWriter):
    """The unary response: one response object."""

    async def write(self, gen: TextGeneration, first: Delta) -> bool:
        request = self.request
        builder = self.builder
        delta = await self.collect(gen, first, builder.add, builder.id)
        if delta is None:
            return False
        status, reason, usage = self._finish(gen, delta.finish_reason)
        builder.finish(status, usage, incomplete_reason=reason)  # closes the items
        final = self.final = builder.response(status, usage, incomplete_reason=reason, completed_at=int(time.time()))
        request.watch.done()
        await send_json(request.send, 200, msgspec.json.encode(final), request.route_headers(gen.request))
        return True


class ResponsesEventWriter(ResponsesWriter):
    """The Responses event stream; a failure after the start is an ``error`` event followed by
    ``response.failed``."""

    async def write(self, gen: TextGeneration, first: Delta) -> bool:
        request = self.request
        builder = self.builder
        await request.send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *request.route_headers(gen.request)]})
        try:
            body, delta = await self.stream(gen, first, builder.start(), builder.add)
            status, reason, usage = self._finish(gen, delta.finish_reason)
            body += builder.finish(status, usage, incomplete_reason=reason)
            self.final = builder.response(status, usage, incomplete_reason=reason, completed_at=int(time.time()))
            await self.end_stream(body)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - headers are out: report in-band, then end the stream
            error = to_http_error(exc, request_id=builder.id)
            detail = json.loads(error.body)["error"]
            logger.warning("response stream failed request_id=%s status=%d error=%s", builder.id, error.status, exc)
            await self.end_stream(builder.fail(str(detail["code"]), detail["message"]))
            return False


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

