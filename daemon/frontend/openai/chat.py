"""``POST /v1/chat/completions``: messages in, ``chat.completion`` (or its chunks) out.

The chat template turns the messages into the prompt; the reply goes through the request's
``OutputParser`` when the model card names a tool-call or reasoning parser, or the request's
``tool_choice`` forces a call (constrained to JSON by ``sampling.py``).
"""

from __future__ import annotations

from typing import Any

from dynamod.daemon.frontend.openai.endpoint import OpenAIEndpoint, make_plan, plan_max_tokens
from dynamod.daemon.frontend.openai.formatters import ChatFormatter, LogprobCollector
from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest, decode_chat_request
from dynamod.daemon.frontend.parsers import OutputParser, ToolSettings, build_output_parser
from dynamod.daemon.frontend.parsers.forced_tool_calls import forced_output_parser, forces_call
from dynamod.daemon.frontend.pipeline.generation import Delta
from dynamod.daemon.frontend.pipeline.metrics import ENDPOINT_CHAT
from dynamod.daemon.frontend.pipeline.models import ServedModel
from dynamod.daemon.frontend.pipeline.request import Plan
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor


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


class ChatCompletionsEndpoint(OpenAIEndpoint[ChatCompletionRequest]):
    endpoint_name = ENDPOINT_CHAT

    def decode(self, body: bytes) -> ChatCompletionRequest:
        return decode_chat_request(body)

    async def plan(self, req: ChatCompletionRequest, model: ServedModel, pre: ModelPreprocessor) -> Plan:
        stops = req.stop_list()
        inputs = await pre.chat_inputs(req, self.state.media)  # image parts: fetched, sized, expanded
        prompt_ids = inputs.token_ids
        max_tokens = plan_max_tokens(len(prompt_ids), req.output_limit(), model.context_length, None)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        plan = make_plan(req, stops, prompt_ids, max_tokens, logprobs, parser=chat_output_parser(req, model))
        plan.mm_items = inputs.mm_items
        return plan

    def sibling_plan(self, req: ChatCompletionRequest, model: ServedModel, plan: Plan) -> Plan:
        if plan.parser is None:
            return plan
        return self.with_parser(plan, chat_output_parser(req, model))

    def formatter(self, req: ChatCompletionRequest, response_id: str, created: int, plan: Plan) -> ChatFormatter:
        return ChatFormatter(
            response_id, created, req.model, include_usage=req.include_usage, continuous_usage=req.continuous_usage,
            return_token_ids=req.return_token_ids, parser=plan.parser,
        )

    def chunk_logprobs(self, collector: LogprobCollector | None, delta: Delta) -> Any:
        if collector is None:
            return None
        return collector.add_chat(delta.token_ids, delta.log_probs, delta.top_logprobs)

    def total_logprobs(self, collector: LogprobCollector | None) -> Any:
        return collector.chat_total() if collector is not None else None
