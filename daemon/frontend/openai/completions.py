"""``POST /v1/completions``: a prompt (text or token ids, or a batch of them) in,
``text_completion`` (or its chunks) out. A batch of prompts is a fan-out (``fanout.py``)."""

from __future__ import annotations

from typing import Any

from dynamod.daemon.frontend.openai.endpoint import OpenAIEndpoint, make_plan, plan_max_tokens
from dynamod.daemon.frontend.openai.formatters import CompletionFormatter, LogprobCollector
from dynamod.daemon.frontend.openai.schema import (
    CompletionRequest,
    completion_prompts,
    decode_completion_request,
)
from dynamod.daemon.frontend.pipeline.generation import Delta
from dynamod.daemon.frontend.pipeline.metrics import ENDPOINT_COMPLETIONS
from dynamod.daemon.frontend.pipeline.models import ServedModel
from dynamod.daemon.frontend.pipeline.request import Plan
from dynamod.daemon.frontend.preprocess.model_preprocessor import ModelPreprocessor
from dynamod.shared.errors import ContextLengthError, InvalidRequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionsEndpoint(OpenAIEndpoint[CompletionRequest]):
    endpoint_name = ENDPOINT_COMPLETIONS

    def decode(self, body: bytes) -> CompletionRequest:
        return decode_completion_request(body)

    async def plan(self, req: CompletionRequest, model: ServedModel, pre: ModelPreprocessor) -> Plan:
        self._check(req)
        prompts = completion_prompts(req)
        if len(prompts) != 1:  # fanout.fans_out sends batches elsewhere; a guard, not a path
            raise InvalidRequestError(f"expected one prompt, got {len(prompts)}", param="prompt")
        return await self._plan_prompt(req, model, pre, prompts[0])

    async def fanout_plans(self, req: CompletionRequest, model: ServedModel, pre: ModelPreprocessor) -> list[Plan]:
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
    ) -> Plan:
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
        return make_plan(req, stops, prompt_ids, max_tokens, req.logprobs, echo_text=echo)

    def formatter(self, req: CompletionRequest, response_id: str, created: int, plan: Plan) -> CompletionFormatter:
        return CompletionFormatter(
            response_id, created, req.model, include_usage=req.include_usage, continuous_usage=req.continuous_usage,
            return_token_ids=req.return_token_ids,
        )

    def chunk_logprobs(self, collector: LogprobCollector | None, delta: Delta) -> Any:
        if collector is None:
            return None
        return collector.add_completion(delta.token_ids, delta.log_probs, delta.top_logprobs)

    def total_logprobs(self, collector: LogprobCollector | None) -> Any:
        return collector.completion_total() if collector is not None else None
