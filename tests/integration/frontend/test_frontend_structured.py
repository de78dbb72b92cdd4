"""Structured outputs, sampling parameters and top logprobs through real processes (a frontend
and a mocker worker) with the official ``openai`` client, unary and streaming.

The mocker constrains its random output with the llguidance grammar engine, so a JSON schema's
answers must validate, a choice must be one of the choices, and a regex must match; options no
engine here can honour must be a 400 naming them rather than a silent 200.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.integration.frontend.test_frontend_support import cluster_fixture, openai_fixture

pytestmark = pytest.mark.timeout(180)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


cluster = cluster_fixture("structured-cluster", workers=1, speedup=100.0)
api = openai_fixture(60)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_unary_and_streaming_validate(api: openai.OpenAI) -> None:
    for seed in range(4):
        resp = api.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=300, seed=seed, response_format=_schema_format(PERSON)
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, seed=7, stream=True, response_format=_schema_format(PERSON)
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_choice_regex_and_grammar(api: openai.OpenAI) -> None:
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    choices = ["red", "green", "dark blue"]
    for seed in range(3):
        resp = api.completions.create(
            model="tiny", prompt="Pick a colour:", max_tokens=20, seed=seed, extra_body={"guided_choice": choices}
        )
        assert resp.choices[0].text in choices
    resp = api.completions.create(
        # [0-9], not \d: the grammar engine's \d takes every Unicode decimal digit of Unicode 16
        # (an outlined digit two, U+1CCF2, came out once), which Python 3.11's re (Unicode 14) rejects.
        model="tiny", prompt="A date:", max_tokens=30, extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", resp.choices[0].text), resp.choices[0].text
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=30,
        extra_body={"nvext": {"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}},
    )
    assert resp.choices[0].message.content in ("yes", "no", "maybe")
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60,
        extra_body={"structured_outputs": {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}}},
    )
    assert all(isinstance(v, bool) for v in json.loads(resp.choices[0].message.content))


def test_invalid_constraints_and_unsupported_options_are_400s(api: openai.OpenAI) -> None:
    cases = [
        ({"response_format": _schema_format({"type": "strin"})}, "response_format"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"bad_words": ["sin"]}}, "bad_words"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **kwargs)
        body = err.value.body
        assert isinstance(body, dict) and body.get("param") == param, (kwargs, body)


def test_sampling_parameters_reach_the_mocker(api: openai.OpenAI) -> None:
    # The mocker honours a ban and an allow-list: the banned token never appears, and only
    # allowed ids come out (return_token_ids shows the ids themselves).
    allowed = [100, 200, 300]
    resp = api.completions.create(
        model="tiny", prompt="Hello", max_tokens=24, presence_penalty=1.0, frequency_penalty=0.5, seed=3,
        logit_bias={"200": -100}, extra_body={"allowed_token_ids": allowed, "repetition_penalty": 1.2, "min_p": 0.01,
                                               "top_k": 50, "return_token_ids": True, "ignore_eos": True},
    )
    ids = resp.choices[0].model_extra["token_ids"]
    assert len(ids) == 24 and set(ids) <= {100, 300}, ids


def test_top_logprobs_chat_and_completions(api: openai.OpenAI) -> None:
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert values[0] >= entry.logprob  # the best alternative is at least as likely as the pick
    stream = api.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, logprobs=2, stream=True, extra_body={"ignore_eos": True}
    )
    tops = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tops.extend(chunk.choices[0].logprobs.top_logprobs or [])
    assert len(tops) == 6 and all(1 <= len(t) <= 2 for t in tops)
