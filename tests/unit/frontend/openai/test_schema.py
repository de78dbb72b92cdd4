"""Request validation, error bodies and response shapes of the OpenAI frontend.

Responses are checked with the official ``openai`` client's own models, so a shape the client
cannot read fails here rather than in a user's program.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatChunk

from dynamod.daemon.frontend.http.errors import to_http_error
from dynamod.daemon.frontend.openai.embeddings import decode_embedding_request
from dynamod.daemon.frontend.openai.endpoint import plan_max_tokens
from dynamod.daemon.frontend.openai.formatters import SSE_DONE, ChatFormatter, CompletionFormatter, make_usage
from dynamod.daemon.frontend.openai.responses.schema import decode_responses_request
from dynamod.daemon.frontend.openai.schema import (
    completion_prompts,
    decode_chat_request,
    decode_completion_request,
)
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
            user="u1", store=False, metadata={"k": "v"}, service_tier="auto",  # accepted, change nothing
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


@pytest.mark.parametrize(
    ("decode", "body", "param", "hint"),
    [
        (decode_chat_request, _chat(foo_bar=1), "foo_bar", None),
        (decode_chat_request, _chat(chat_template="{{ messages }}"), "chat_template", "chat_template_kwargs"),
        (decode_chat_request, _chat(functions=[]), "functions", "'tools'"),
        (decode_chat_request, _chat(nvext={"ignore_eos": True, "routr": {}}), "nvext.routr", None),
        (decode_chat_request, _chat(stream_options={"include_usage": True, "x": 1}), "stream_options.x", None),
        (decode_completion_request, b'{"model":"m","prompt":"hi","max_token":3}', "max_token", "max_tokens"),
        (decode_responses_request, b'{"model":"m","input":"hi","max_tokens":3}', "max_tokens", None),
        (decode_embedding_request, b'{"model":"m","input":"hi","dims":3}', "dims", None),
    ],
)
def test_an_unknown_field_is_a_400_naming_it(decode: Any, body: bytes, param: str, hint: str | None) -> None:
    """OpenAI answers "Unrecognized request argument supplied"; serving the request as if a misspelt
    or unsupported field had been honoured would hide the caller's mistake."""
    with pytest.raises(InvalidRequestError) as info:
        decode(body)
    assert info.value.param == param
    message = json.loads(to_http_error(info.value).body)["error"]["message"]
    assert message.startswith(f"Unrecognized request argument supplied: {param}")
    assert hint is None or hint in message


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


# -- sampling options and structured outputs (daemon/frontend/openai/sampling.py) ------------------------


def _chat(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _options(body: bytes, logprobs: int | None = None):
    from dynamod.daemon.frontend.openai.sampling import sampling_options

    return sampling_options(decode_chat_request(body), logprobs=logprobs, vocab_size=4096)


def test_every_sampling_field_reaches_the_wire() -> None:
    from dynamod.shared.protocol.llm import PreprocessedRequest

    opts = _options(
        _chat(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, presence_penalty=0.5, frequency_penalty=-0.5,
              repetition_penalty=1.1, logit_bias={"12": -100, "13": 2.5}, allowed_token_ids=[12, 13, 14]),
        logprobs=3,
    )
    wire = msgspec.msgpack.decode(
        msgspec.msgpack.encode(PreprocessedRequest(request_id="r", model="m", token_ids=[1], sampling=opts)),
        type=PreprocessedRequest,
    ).sampling
    assert (wire.temperature, wire.top_p, wire.top_k, wire.min_p, wire.seed) == (0.5, 0.9, 40, 0.05, 7)
    assert (wire.presence_penalty, wire.frequency_penalty, wire.repetition_penalty) == (0.5, -0.5, 1.1)
    assert wire.logit_bias == {12: -100.0, 13: 2.5} and wire.allowed_token_ids == [12, 13, 14] and wire.logprobs == 3
    # A request without any of them keeps the wire lean: nothing but what it set.
    assert msgspec.msgpack.encode(_options(_chat())) == b"\x80"  # an empty map


@pytest.mark.parametrize(
    ("fields", "kind", "check"),
    [
        ({"response_format": {"type": "json_object"}}, "json", {"type": "object"}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"},
                                                                      "strict": True}}}, "json", {"type": "integer"}),
        ({"response_format": {"type": "text"}}, None, None),
        ({"guided_json": '{"type": "string"}'}, "json", {"type": "string"}),
        ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
        ({"guided_choice": ["x", "y"]}, "choice", ["x", "y"]),
        ({"guided_choice": []}, None, None),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
        ({"nvext": {"guided_regex": "z+"}}, "regex", "z+"),
        ({"structured_outputs": {"choice": ["p", "q"]}}, "choice", ["p", "q"]),
        ({"structured_outputs": {"json_object": True}}, "json", {"type": "object"}),
    ],
)
def test_output_constraints_in_every_spelling(fields: dict, kind: str | None, check: object) -> None:
    guided = _options(_chat(**fields)).guided_decoding
    if kind is None:
        assert guided is None
        return
    assert guided is not None and guided.kind == kind
    assert getattr(guided, kind) == check


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}},
         "response_format", "Invalid type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format.json_schema",
         "needs json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be text"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type", "not supported"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
        ({"nvext": {"guided_grammar": "start: nowhere"}}, "nvext.guided_grammar", "invalid grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one output constraint"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
        ({"use_beam_search": True}, "use_beam_search", "beam search"),
        ({"length_penalty": 0.5}, "length_penalty", "beam search"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "not supported"),
        ({"skip_special_tokens": False}, "skip_special_tokens", "not supported"),
        ({"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
        ({"bad_words": ["x"]}, "bad_words", "logit_bias"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "picks"),
        ({"logit_bias": {"5000": 1}}, "logit_bias", "out of the vocabulary"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs set to true"),
    ],
)
def test_unhonourable_options_are_400s_naming_them(fields: dict, param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as err:
        _options(_chat(**fields))
    assert err.value.param == param
    assert to_http_error(err.value).status == 400


def test_default_valued_vllm_fields_are_accepted() -> None:
    opts = _options(_chat(use_beam_search=False, length_penalty=1.0, skip_special_tokens=True, bad_words=[],
                          include_stop_str_in_output=False, logits_processors=[]))
    assert opts.guided_decoding is None


def test_logit_bias_keys_and_values_are_validated_at_decode() -> None:
    for bias, param in (({"a": 1}, "logit_bias"), ({"3": 101}, "logit_bias[...]")):
        with pytest.raises(InvalidRequestError) as err:
            decode_chat_request(_chat(logit_bias=bias))
        assert err.value.param == param


def test_top_logprobs_reach_chat_and_completion_bodies() -> None:
    from dynamod.daemon.frontend.openai.formatters import LogprobCollector

    class Pre:
        @staticmethod
        def token_text(token_id: int) -> str:
            return {1: "a", 2: "b", 3: "c"}[token_id]

    collector = LogprobCollector(Pre())  # type: ignore[arg-type]
    chat = collector.add_chat([1, 2], [-0.1, -0.7], [[[1, -0.1], [3, -2.0]], [[3, -0.5], [2, -0.7]]])
    body = ChatFormatter("x", 1, "tiny", include_usage=False, continuous_usage=False).response(
        "ab", "stop", collector.chat_total(), make_usage(1, 2, 0)
    )
    parsed = OpenAIChatCompletion.model_validate_json(body)
    entries = parsed.choices[0].logprobs.content
    assert [t.token for t in entries[1].top_logprobs] == ["c", "b"] and entries[1].top_logprobs[0].logprob == -0.5
    assert chat is not None and len(chat.content) == 2
    completion = LogprobCollector(Pre())  # type: ignore[arg-type]
    piece = completion.add_completion([1], [-0.1], [[[1, -0.1], [3, -2.0]]])
    assert piece is not None and piece.top_logprobs == [{"a": -0.1, "c": -2.0}]
    body = CompletionFormatter("y", 1, "tiny", include_usage=False, continuous_usage=False).response(
        "a", "stop", completion.completion_total(), make_usage(1, 1, 0)
    )
    assert OpenAICompletion.model_validate_json(body).choices[0].logprobs.top_logprobs == [{"a": -0.1, "c": -2.0}]
