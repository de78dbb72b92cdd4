"""``tool_choice`` ``required`` and a named function, enforced by guided decoding, through real
processes (a frontend and a mocker worker whose card names no tool-call parser) with the official
``openai`` client: the mocker samples random tokens under the tool-call schema's masks, so every
reply must come back as valid tool calls whose arguments validate against their tool's schema,
unary and streaming, 20 generations each (one ``n=20`` request)."""

from __future__ import annotations

import json
from collections import defaultdict

import jsonschema
import openai
import pytest

from tests.integration.frontend.test_frontend_support import WEATHER, cluster_fixture, openai_fixture

pytestmark = pytest.mark.timeout(180)

TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}, "precise": {"type": "boolean"}},
    "required": ["zone", "precise"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
N = 20


cluster = cluster_fixture("tool-choice-cluster", workers=1, speedup=100.0)
api = openai_fixture(120)


def _check_calls(calls: list[tuple[str, str, str]], *, only: str | None = None) -> None:
    """(id, name, arguments) triples: known names, distinct ids, arguments valid for the tool."""
    assert calls
    assert len({c[0] for c in calls}) == len(calls)
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_")
        assert name in SCHEMAS and (only is None or name == only), name
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice_unary(api: openai.OpenAI) -> None:
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, n=N, max_tokens=200, seed=1
    )
    assert len(resp.choices) == N
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice  # OpenAI's reason when the function was named
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        _check_calls([(c.id, c.function.name, c.function.arguments) for c in calls], only="get_weather")


def _streamed_calls(stream: openai.Stream) -> tuple[dict[int, list[tuple[str, str, str]]], dict[int, str], dict[int, str]]:
    """Per choice: its calls rebuilt from the deltas, its finish reason, and any content."""
    parts: dict[int, dict[int, list[str]]] = defaultdict(dict)  # choice -> call index -> [id, name, args]
    finish: dict[int, str] = {}
    content: dict[int, str] = defaultdict(str)
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content[choice.index] += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = parts[choice.index].get(tc.index)
                if entry is None:  # a call's first delta carries its id and name
                    assert tc.id and tc.function and tc.function.name, tc
                    entry = parts[choice.index][tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None
                entry[2] += (tc.function.arguments or "") if tc.function else ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    calls = {i: [tuple(v) for _, v in sorted(c.items())] for i, c in parts.items()}
    return calls, finish, content  # type: ignore[return-value]


def test_named_tool_choice_streaming(api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, n=N, max_tokens=200, seed=2, stream=True
    )
    calls, finish, content = _streamed_calls(stream)
    assert set(finish) == set(range(N)) and set(finish.values()) == {"stop"}
    assert not any(content.values())
    for i in range(N):
        assert len(calls[i]) == 1
        _check_calls(calls[i], only="get_weather")


def test_required_tool_choice_unary_and_streaming(api: openai.OpenAI) -> None:
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=N, max_tokens=400, seed=3
    )
    names = set()
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        _check_calls(calls)
        names.update(c[1] for c in calls)
    assert names == set(SCHEMAS), "both tools are reachable under the constraint"
    stream = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=N, max_tokens=400, seed=4, stream=True
    )
    calls, finish, content = _streamed_calls(stream)
    assert set(finish) == set(range(N)) and set(finish.values()) == {"tool_calls"}
    assert not any(content.values())
    for i in range(N):
        _check_calls(calls[i])


def test_required_without_parallel_calls_gives_exactly_one(api: openai.OpenAI) -> None:
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=10, max_tokens=300, seed=5,
    )
    for choice in resp.choices:
        calls = choice.message.tool_calls or []
        assert len(calls) == 1, choice
        _check_calls([(c.id, c.function.name, c.function.arguments) for c in calls])


def test_tool_choice_with_its_own_output_format_is_a_400(api: openai.OpenAI) -> None:
    cases = [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": NAMED, "extra_body": {"guided_regex": "a+"}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=5, **kwargs)
        body = err.value.body
        assert isinstance(body, dict) and body.get("param") == param, (kwargs, body)
    # auto and none leave the output free (and text is fine with them).
    resp = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5, response_format={"type": "text"}
    )
    assert resp.choices[0].message.tool_calls is None
