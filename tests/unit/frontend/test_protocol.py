"""Request validation, error bodies and response shapes of the OpenAI frontend.

Responses are checked with the official ``openai`` client's own models, so a shape the client
cannot read fails here rather than in a user's program.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatChunk

from dynamod.daemon.frontend.endpoints import plan_max_tokens
from dynamod.daemon.frontend.errors import to_http_error
from dynamod.daemon.frontend.formatters import SSE_DONE, ChatFormatter, CompletionFormatter, make_usage
from dynamod.daemon.frontend.preprocess.model_preprocessor import completion_prompts
from dynamod.daemon.frontend.protocol import decode_chat_request, decode_completion_request
from dynamod.shared.errors import (
    ContextLengthError,
    InvalidRequestError,
    NoInstancesError,
    NotFoundError,
    OverloadedError,
    RemoteError,
)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _chat(**extra: object) -> bytes:
    return json.dumps({**CHAT, **extra}).encode()


def test_chat_request_decodes_openai_fields() -> None:
    req = decode_chat_request(
        _chat(
            max_completion_tokens=5, max_tokens=9, temperature=0.5, top_p=0.9, seed=7, stop=["a", "b"],
            stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2, ignore_eos=True,
            some_future_field={"x": 1},
        )
    )
    assert req.output_limit() == 5  # max_completion_tokens wins
    assert req.stop_list() == ["a", "b"]
    assert req.include_usage and req.wants_ignore_eos and req.stream
    assert req.seed == 7 and req.top_logprobs == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(max_tokens="12"), "max_tokens"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_tokens=10**30), "max_tokens"),
        (_chat()[:-1] + b', "max_tokens": 1e400}', "max_tokens"),
        (_chat(temperature=3), "temperature"),
        (_chat(top_p=0), "top_p"),
        (_chat(n=0), "n"),
        (_chat(seed=2**70), "seed"),
        (_chat(stream="yes"), "stream"),
        (_chat(stop=[1, 2]), "stop[0]"),
        (json.dumps({"messages": []}).encode(), "model"),
        (json.dumps({"model": "tiny"}).encode(), "messages"),
    ],
)
def test_bad_parameters_name_the_parameter(body: bytes, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_chat_request(body)
    assert info.value.param == param
    assert to_http_error(info.value).status == 400


@pytest.mark.parametrize("body", [b"", b"{", b'{"model": "tiny", "messages": [', b"[1, 2]", b"null", b"\xff\xfe"])
def test_malformed_json_is_a_400(body: bytes) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_chat_request(body)
    err = to_http_error(info.value)
    assert err.status == 400
    detail = json.loads(err.body)["error"]
    assert detail["type"] == "invalid_request_error" and detail["message"]


def test_completion_prompt_forms() -> None:
    assert completion_prompts(decode_completion_request(b'{"model":"m","prompt":"hi"}')) == ["hi"]
    assert completion_prompts(decode_completion_request(b'{"model":"m","prompt":[1,2,3]}')) == [[1, 2, 3]]
    assert completion_prompts(decode_completion_request(b'{"model":"m","prompt":["a","b"]}')) == ["a", "b"]
    assert completion_prompts(decode_completion_request(b'{"model":"m","prompt":[[1],[2,3]]}')) == [[1], [2, 3]]
    for bad in (b'{"model":"m","prompt":[]}', b'{"model":"m","prompt":[1,"a"]}', b'{"model":"m","prompt":[-1]}'):
        with pytest.raises(InvalidRequestError):
            completion_prompts(decode_completion_request(bad))


def test_too_many_stop_sequences_rejected() -> None:
    req = decode_chat_request(_chat(stop=[str(i) for i in range(17)]))
    with pytest.raises(InvalidRequestError):
        req.stop_list()


def test_error_statuses_and_retry_hint() -> None:
    assert to_http_error(NotFoundError("no model")).status == 404
    assert json.loads(to_http_error(NotFoundError("x")).body)["error"]["code"] == "model_not_found"
    overloaded = to_http_error(OverloadedError("busy", retry_after_s=2.0))
    assert overloaded.status == 503 and (b"retry-after", b"2") in overloaded.headers
    assert to_http_error(NoInstancesError("none")).status == 503
    assert to_http_error(RemoteError("engine", remote_code="engine_error", http_status=500)).status == 500


def test_bug_gives_500_without_traceback() -> None:
    err = to_http_error(KeyError("secret internal detail"), request_id="r1")
    assert err.status == 500
    text = err.body.decode()
    assert "secret" not in text and "Traceback" not in text and "r1" in text


def test_context_length_numbers() -> None:
    assert plan_max_tokens(10, None, 100, None) == 90
    assert plan_max_tokens(10, None, 100, 16) == 16
    assert plan_max_tokens(10, 50, 100, 16) == 50
    with pytest.raises(ContextLengthError) as info:
        plan_max_tokens(100, None, 100, None)
    assert "100" in str(info.value)
    with pytest.raises(ContextLengthError) as info:
        plan_max_tokens(60, 50, 100, None)
    assert "110" in str(info.value) and "60" in str(info.value) and info.value.param == "max_tokens"


def _sse_payloads(data: bytes) -> list[str]:
    return [line[len("data: ") :] for line in data.decode().split("\n\n") if line]


def test_chat_chunks_parse_with_openai_client_models() -> None:
    fmt = ChatFormatter("abc", 1700000000, "tiny", include_usage=True, continuous_usage=False)
    first = fmt.chunk("Hel", None, None, None)
    last = fmt.chunk("lo", "stop", None, None)
    usage = fmt.usage_chunk(make_usage(5, 2, 3))
    chunks = [OpenAIChatChunk.model_validate_json(p) for p in _sse_payloads(first + last + usage)]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == "Hel"
    assert chunks[0].usage is None
    assert chunks[1].choices[0].finish_reason == "stop"
    assert chunks[2].choices == [] and chunks[2].usage.prompt_tokens_details.cached_tokens == 3
    assert chunks[2].usage.total_tokens == 7
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_unary_bodies_parse_with_openai_client_models() -> None:
    chat = OpenAIChatCompletion.model_validate_json(
        ChatFormatter("x", 1, "tiny", include_usage=False, continuous_usage=False).response("hi", "length", None, make_usage(3, 1, 0))
    )
    assert chat.choices[0].message.content == "hi" and chat.usage.completion_tokens == 1
    comp = OpenAICompletion.model_validate_json(
        CompletionFormatter("y", 1, "tiny", include_usage=False, continuous_usage=False).response("ok", "stop", None, make_usage(2, 1, 1))
    )
    assert comp.choices[0].text == "ok" and comp.usage.prompt_tokens_details.cached_tokens == 1
    assert msgspec.json.decode(
        CompletionFormatter("y", 1, "tiny", include_usage=False, continuous_usage=False).chunk("a", None, None, None)[6:-2]
    )["object"] == "text_completion"
