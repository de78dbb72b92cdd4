"""What ``POST /v1/chat/completions`` and ``POST /v1/completions`` share on top of the pipeline.

    body -> validated request -> cost (prompts x n) -> model -> prompt token ids -> context check
         -> EngineStream -> TextGeneration (detokenize, stop strings) -> [chat: OutputParser]
         -> SseChunkWriter (SSE chunks) or JsonWriter (one JSON body)

The door, admission and ``serve`` are ``pipeline/serve.py``'s; this adds the OpenAI pieces: the
fan-out cost check at the door, the plan's budget (``plan_max_tokens``), the sampling options, and
the choice of writer. Chat replies of a model whose card names a tool-call or reasoning parser go
through an ``OutputParser`` (``parsers/``) built per request: tool calls come back as
``tool_calls``, reasoning as ``reasoning_content``. No parser, no cost: the text goes straight to
``content``. A request with several choices (``n > 1``, batched completion prompts) goes to
``fanout.py``, which runs the same steps once per choice; ``n=1`` never touches it.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import Any, TypeVar

from dynamod.daemon.frontend.http.asgi import Scope
from dynamod.daemon.frontend.openai import fanout
from dynamod.daemon.frontend.openai.formatters import ChatFormatter, CompletionFormatter, LogprobCollector
from dynamod.daemon.frontend.openai.sampling import sampling_options
from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest, CompletionRequest
from dynamod.daemon.frontend.openai.writers import JsonWriter, SseChunkWriter
from dynamod.daemon.frontend.parsers import OutputParser
from dynamod.daemon.frontend.pipeline.generation import Delta, TextGeneration
from dynamod.daemon.frontend.pipeline.models import ServedModel
from dynamod.daemon.frontend.pipeline.request import FrontendRequest, Plan
from dynamod.daemon.frontend.pipeline.serve import GenerationEndpoint, ResponseWriter
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.shared.errors import ContextLengthError

OpenAIBody = TypeVar("OpenAIBody", ChatCompletionRequest, CompletionRequest)

FALLBACK_MAX_TOKENS = 4096  # a card without a context length: some bound is needed


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


def make_plan(
    req: ChatCompletionRequest | CompletionRequest,
    stops: list[str],
    prompt_ids: list[int],
    max_tokens: int,
    logprobs: int | None,
    echo_text: str = "",
    parser: OutputParser | None = None,
) -> Plan:
    """A plan from an OpenAI request's own fields (its sampling options are set by ``start``,
    once per request, so a fan-out compiles its grammar once)."""
    nvext = req.nvext
    return Plan(
        prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=None, logprobs=logprobs, echo_text=echo_text,
        stops=stops, parser=parser, min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.wants_ignore_eos, sla=nvext.sla_targets() if nvext is not None else None,
        routing=nvext.routing_hints() if nvext is not None else None,
        pin=nvext.prefix_pin(len(prompt_ids)) if nvext is not None else None,
    )


class OpenAIEndpoint(GenerationEndpoint[OpenAIBody]):
    """The chat and completions endpoints' shared part; subclasses plan and format."""

    # -- endpoint-specific ------------------------------------------------------------------------

    @abstractmethod
    async def plan(self, req: OpenAIBody, model: ServedModel, pre: ModelPreprocessor) -> Plan:
        """Prompt token ids, output budget and the options generation needs."""

    @abstractmethod
    def formatter(self, req: OpenAIBody, response_id: str, created: int, plan: Plan) -> ChatFormatter | CompletionFormatter:
        """The response format of this endpoint."""

    @abstractmethod
    def chunk_logprobs(self, collector: LogprobCollector | None, delta: Delta) -> Any:
        """The ``logprobs`` object of one chunk (None when not asked for or not given)."""

    @abstractmethod
    def total_logprobs(self, collector: LogprobCollector | None) -> Any:
        """The ``logprobs`` object of a whole (unary) response."""

    async def fanout_plans(self, req: OpenAIBody, model: ServedModel, pre: ModelPreprocessor) -> list[Plan]:
        """One plan per prompt of a fan-out request (chat has one prompt)."""
        return [await self.plan(req, model, pre)]

    def sibling_plan(self, req: OpenAIBody, model: ServedModel, plan: Plan) -> Plan:
        """``plan`` for another choice of the same prompt: the same prompt and budget, with an
        output parser of its own (parsers keep per-reply state)."""
        return plan

    # -- the pipeline's steps ---------------------------------------------------------------------

    def model_name(self, body: OpenAIBody) -> str:
        return body.model

    def admit(self, scope: Scope, body: OpenAIBody) -> int:
        return fanout.check_fanout(scope, body, self.state)  # prompts x n: capped, rate-charged, admitted

    async def respond(self, request: FrontendRequest[OpenAIBody]) -> str:
        if fanout.fans_out(request.body):  # n > 1 or batched prompts: several generations, one response
            return await fanout.serve(request, self)
        return await self.serve(request, self.writer(request))

    async def start(self, request: FrontendRequest[OpenAIBody]) -> TextGeneration:
        model = request.model
        pre = request.preprocessor = await model.preprocessor()
        plan = await self.plan(request.body, model, pre)
        plan.sampling = sampling_options(request.body, logprobs=plan.logprobs, vocab_size=pre.vocab_size)
        request.plan = plan
        return self.open_generation(request, plan, request.request_id)

    def writer(self, request: FrontendRequest[OpenAIBody]) -> ResponseWriter:
        if request.stream:
            return SseChunkWriter(request, self, self.state.config.coalesce_s)
        return JsonWriter(request, self)

    @staticmethod
    def with_parser(plan: Plan, parser: OutputParser | None) -> Plan:
        return dataclasses.replace(plan, parser=parser)
