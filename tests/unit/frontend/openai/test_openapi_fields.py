"""The OpenAPI document's hand-written shapes (``openapi_fields``) agree with the checks they
describe: every chat message list, completion prompt and Responses input the document admits is
accepted by the frontend's own check, and what those checks refuse the document refuses too."""

from __future__ import annotations

from typing import Any

import hypothesis
import jsonschema
import msgspec
import pytest

from dynamod.daemon.frontend.openai.openapi import build_document
from dynamod.daemon.frontend.openai.responses.schema import ResponsesRequest, input_messages
from dynamod.daemon.frontend.openai.schema import ChatCompletionRequest, CompletionRequest, completion_prompts
from dynamod.daemon.frontend.preprocess.chat_template import normalize_messages
from dynamod.shared.errors import InvalidRequestError
from tests.fixtures.openapi import whole_numbers

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation import GenerationMode  # noqa: E402

DOC = build_document({"chat": ["tiny"]}, api_keys=False, vocab_size=4096, context_length=8192)
SCHEMAS = DOC["components"]["schemas"]


def _bodies(path: str):
    schema = schemathesis.openapi.from_dict(DOC)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE])
    (operation,) = [r.ok() for r in schema.get_all_operations() if r.ok().label == f"POST {path}"]
    return operation.as_strategy().map(lambda case: whole_numbers(case.body))


_SETTINGS = hypothesis.settings(max_examples=60, deadline=None, derandomize=True, database=None,
                                phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                                suppress_health_check=list(hypothesis.HealthCheck))


@_SETTINGS
@hypothesis.given(body=_bodies("/v1/chat/completions"))
def test_every_admitted_chat_body_passes_the_message_check(body: dict) -> None:
    request = msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)
    normalize_messages(request.messages)


@_SETTINGS
@hypothesis.given(body=_bodies("/v1/completions"))
def test_every_admitted_completion_prompt_passes_the_prompt_check(body: dict) -> None:
    request = msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)
    for prompt in completion_prompts(request):
        assert isinstance(prompt, str) or all(0 <= t < 4096 for t in prompt)


@_SETTINGS
@hypothesis.given(body=_bodies("/v1/responses"))
def test_every_admitted_responses_input_passes_the_input_check(body: dict) -> None:
    request = msgspec.json.decode(msgspec.json.encode(body), type=ResponsesRequest)
    try:
        input_messages(request.input)
    except InvalidRequestError as exc:  # arguments must be JSON text: annotated, not generated
        assert "arguments" in str(exc), exc


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": None, "content": "hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ["hello"],
    ],
)
def test_messages_the_check_refuses_the_document_refuses(messages: list) -> None:
    with pytest.raises(InvalidRequestError):
        normalize_messages(messages)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(messages, SCHEMAS["ChatCompletionRequest"]["properties"]["messages"])


@pytest.mark.parametrize("prompt", [[], [1.5], [[]], ["a", 1], [4096]])
def test_prompts_the_check_refuses_the_document_refuses(prompt: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(prompt, SCHEMAS["CompletionRequest"]["properties"]["prompt"])


def test_served_models_bound_token_ids_and_output_lengths() -> None:
    chat = SCHEMAS["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 8191
    assert chat["allowed_token_ids"]["anyOf"][0]["items"]["maximum"] == 4095
    assert SCHEMAS["ResponsesRequest"]["properties"]["max_output_tokens"]["anyOf"][0]["maximum"] == 8191
    unbounded = build_document({"chat": ["tiny"]}, api_keys=False)["components"]["schemas"]
    assert unbounded["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 2**31 - 1


def test_refused_vllm_fields_admit_only_their_off_values() -> None:
    props = SCHEMAS["CompletionRequest"]["properties"]
    assert props["use_beam_search"]["enum"] == [None, False]
    assert props["length_penalty"]["enum"] == [None, 1]
    assert props["prompt_logprobs"]["enum"] == [None]
