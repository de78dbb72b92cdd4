"""``tool_choice`` required/named: the schema the output is constrained to (checked by llguidance,
as the frontend compiles it), and the parsers that read the constrained output back as calls,
fed whole and split at every boundary (the calls must not depend on the split, and a call's id
and name must come first, then only its arguments)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.frontend.openai.sampling import guided_decoding
from dynamod.daemon.frontend.openai.schema import decode_chat_request
from dynamod.daemon.frontend.parsers import OutputParser, ToolSettings
from dynamod.daemon.frontend.parsers.forced_tool_calls import (
    forced_call_schema,
    forced_output_parser,
    forces_call,
)
from dynamod.shared.errors import InvalidRequestError

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARRAY = (
    '[{"name": "get_weather", "parameters": {"city": "a \\"[b]\\" {c}, \\\\", "name": "x"}},\n'
    ' {"name":"get_time","parameters":{}}]'
)
ARRAY_CALLS = [("get_weather", {"city": 'a "[b]" {c}, \\', "name": "x"}), ("get_time", {})]


def settings_for(choice: object, parallel: bool | None = None) -> ToolSettings:
    return ToolSettings.from_request(TOOLS, choice, parallel)


def run(parser: OutputParser, pieces: list[str]) -> tuple[list[tuple[str, dict]], str, str | None]:
    """Feeds the pieces as a stream; returns the calls rebuilt from the deltas, the content and
    the finish reason, after checking the deltas' shape."""
    calls: dict[int, list[str]] = {}
    content = ""
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    for out in outs:
        content += out.content
        for d in out.tool_calls:
            if d.index not in calls:
                assert d.id is not None and d.name is not None, d
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None, d
            calls[d.index][1] += d.arguments
    rebuilt = [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]
    whole = [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]
    assert rebuilt == whole
    return rebuilt, content, parser.finish_reason("stop")


def test_named_schema_is_the_functions_parameters() -> None:
    assert forced_call_schema(settings_for(NAMED), TOOLS) == CITY
    time = {"type": "function", "function": {"name": "get_time"}}
    assert forced_call_schema(settings_for(time), TOOLS) == {"type": "object", "properties": {}}


def test_required_schema_is_an_array_of_name_and_parameters() -> None:
    schema = forced_call_schema(settings_for("required"), TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [["get_weather"], ["get_time"]]
    assert variants[0]["properties"]["parameters"] == CITY
    assert forced_call_schema(settings_for("required", parallel=False), TOOLS)["maxItems"] == 1


def test_required_schema_lifts_defs_and_refuses_clashes() -> None:
    def tool(name: str, defs: dict) -> dict:
        params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    tools = [tool("a", {"P": {"type": "integer"}}), tool("b", {"P": {"type": "integer"}})]
    schema = forced_call_schema(ToolSettings.from_request(tools, "required", None), tools)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's own tools are left as they were
    clash = [tool("a", {"P": {"type": "integer"}}), tool("b", {"P": {"type": "string"}})]
    with pytest.raises(InvalidRequestError) as err:
        forced_call_schema(ToolSettings.from_request(clash, "required", None), clash)
    assert err.value.param == "tools"


def test_guided_decoding_follows_tool_choice() -> None:
    def req(**fields: object) -> object:
        body = {"model": "m", "messages": [], "tools": TOOLS, **fields}
        return decode_chat_request(json.dumps(body).encode())

    assert guided_decoding(req(tool_choice="auto")) is None
    assert guided_decoding(req(tool_choice="none")) is None
    assert guided_decoding(req(tool_choice=NAMED)).json == CITY
    assert guided_decoding(req(tool_choice="required")).json["type"] == "array"
    for other in ({"response_format": {"type": "json_object"}}, {"guided_choice": ["a"]}):
        with pytest.raises(InvalidRequestError) as err:
            guided_decoding(req(tool_choice="required", **other))
        assert err.value.param == "tool_choice"
    bad = [{"type": "function", "function": {"name": "f", "parameters": [1]}}]
    with pytest.raises(InvalidRequestError) as err:
        guided_decoding(req(tools=bad, tool_choice="required"))
    assert err.value.param == "tools[0].function.parameters"


def test_forces_call_only_for_required_and_named() -> None:
    assert forces_call(settings_for("required")) and forces_call(settings_for(NAMED))
    assert not forces_call(settings_for("auto")) and not forces_call(settings_for("none")) and not forces_call(None)


@pytest.mark.parametrize("split", range(len('{"city": "Oslo"}') + 1))
def test_named_output_is_one_call_whatever_the_split(split: int) -> None:
    text = '{"city": "Oslo"}'
    calls, content, finish = run(forced_output_parser(settings_for(NAMED)), [text[:split], text[split:]])
    assert calls == [("get_weather", {"city": "Oslo"})]
    assert content == "" and finish == "stop"  # OpenAI: a named function's call finishes with stop


@pytest.mark.parametrize("split", range(len(ARRAY) + 1))
def test_required_output_is_its_calls_whatever_the_split(split: int) -> None:
    calls, content, finish = run(forced_output_parser(settings_for("required")), [ARRAY[:split], ARRAY[split:]])
    assert calls == ARRAY_CALLS
    assert content == "" and finish == "tool_calls"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ARRAY)), max_size=12))
def test_required_output_in_random_pieces(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(ARRAY)]
    pieces = [ARRAY[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    calls, _, _ = run(forced_output_parser(settings_for("required")), pieces)
    assert calls == ARRAY_CALLS


def test_required_streams_arguments_before_the_call_is_complete() -> None:
    parser = forced_output_parser(settings_for("required"))
    first = parser.feed('[{"name": "get_weather", "parameters": {"ci')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", '{"ci')]
    more = parser.feed('ty": "Rome"}}]')
    assert [(d.id, d.arguments) for d in more.tool_calls] == [(None, 'ty": "Rome"}')]


def test_required_without_parallel_calls_keeps_the_first() -> None:
    calls, _, _ = run(forced_output_parser(settings_for("required", parallel=False)), [ARRAY])
    assert calls == ARRAY_CALLS[:1]


def test_output_that_is_no_call_array_comes_back_as_content() -> None:
    # An engine that ignored the constraint: the text is not lost, and it is no tool call.
    parser = forced_output_parser(settings_for("required"))
    calls, content, finish = run(parser, ["I would rather ", "chat."])
    assert calls == [] and content == "I would rather chat." and finish == "stop"


def test_a_cut_output_keeps_what_arrived_and_its_length_reason() -> None:
    parser = forced_output_parser(settings_for("required"))
    parser.feed('[{"name": "get_weather", "parameters": {"city": "Os')
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("get_weather", '{"city": "Os')]
    assert parser.finish_reason("length") == "length"
