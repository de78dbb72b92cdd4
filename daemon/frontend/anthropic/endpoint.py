"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API.

    body -> MessagesRequest -> AnthropicChatRequest (convert.py)
         -> the chat pipeline (template, tokens, budget, sampling, guided decoding of a forced
            tool call, route, migrate, detokenize, stop sequences)
         -> OutputSplitter (text / thinking / tool_use) -> MessageBuilder
         -> one message, or Anthropic's event stream

``MessagesEndpoint`` is the chat endpoint with another way in and another way out, as the
Responses endpoint is: ``decode`` converts, the chat ``plan`` (with its output parser: the model
card's reasoning and tool-call parsers, or the forced-call parser of ``tool_choice`` any/tool),
the pipeline's ``start`` and ``serve`` run unchanged, and the writers (``writers.py``) speak
Anthropic. Every error, at the door or later, has Anthropic's shape.

``cache_control`` marks become the request's pin (``cache_control.py``), counted on the prompt
after the chat template; they win over ``nvext.cache_control``.

``count_tokens`` renders the same prompt (the same conversion and chat template) and counts its
tokens, without routing anything.
"""

from __future__ import annotations

from typing import Any

from dynamod.daemon.frontend.anthropic.cache_control import pin_for
from dynamod.daemon.frontend.anthropic.convert import AnthropicChatRequest, to_chat_request
from dynamod.daemon.frontend.anthropic.errors import to_anthropic_error
from dynamod.daemon.frontend.anthropic.schema import (
    TokensCount,
    decode_count_tokens_request,
    decode_messages_request,
    encoder,
)
from dynamod.daemon.frontend.anthropic.writers import MessageEventWriter, MessageJsonWriter
from dynamod.daemon.frontend.http.asgi import Scope, read_body, send_error, send_json
from dynamod.daemon.frontend.openai.chat import ChatCompletionsEndpoint
from dynamod.daemon.frontend.parsers.output import ToolSettings
from dynamod.daemon.frontend.pipeline.models import ServedModel
from dynamod.daemon.frontend.pipeline.request import FrontendRequest, Plan
from dynamod.daemon.frontend.pipeline.serve import ResponseWriter
from dynamod.daemon.frontend.pipeline.state import FrontendState
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor

ENDPOINT_MESSAGES = "messages"  # the metrics' endpoint label
ENDPOINT_COUNT_TOKENS = "count_tokens"


class MessagesEndpoint(ChatCompletionsEndpoint):
    endpoint_name = ENDPOINT_MESSAGES

    def decode(self, body: bytes) -> AnthropicChatRequest:
        return to_chat_request(decode_messages_request(body))

    async def plan(self, req: AnthropicChatRequest, model: ServedModel, pre: ModelPreprocessor) -> Plan:  # type: ignore[override]
        plan = await super().plan(req, model, pre)
        pin = await pin_for(req, pre, plan.prompt_ids)  # cache_control marks win over nvext.cache_control
        if pin is not None:
            plan.pin = pin
        return plan

    async def refuse(self, send: Any, exc: BaseException, request_id: str) -> None:
        await send_error(send, to_anthropic_error(exc, request_id=request_id))

    async def respond(self, request: FrontendRequest[Any]) -> str:
        return await self.serve(request, self.writer(request))  # one message per request: no fan-out

    def writer(self, request: FrontendRequest[Any]) -> ResponseWriter:
        return MessageEventWriter(request) if request.stream else MessageJsonWriter(request)


class CountTokensEndpoint:
    """The prompt's token count for a Messages request, as the model would see it."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        try:
            req = to_chat_request(decode_count_tokens_request(await read_body(receive)))
            ToolSettings.from_request(req.tools, req.tool_choice, req.parallel_tool_calls)  # the 400s of a real request
            model = self.state.registry.get(req.model)
            pre = await model.preprocessor()
            count = len(await pre.chat_prompt(req))
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
            await send_error(send, to_anthropic_error(exc))
            return
        await send_json(send, 200, encoder.encode(TokensCount(input_tokens=count)))
