"""The request's tool settings and how they steer the parsers; the held-back-marker rule; the
detokenizer keeping the special tokens a parser reads."""

from __future__ import annotations

import pytest

from dynamod.daemon.frontend.parsers import ToolSettings, build_output_parser
from dynamod.daemon.frontend.parsers.base import held_marker_len
from dynamod.daemon.frontend.preprocess import IncrementalDetokenizer, Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.errors import InvalidRequestError

from .test_recorded_outputs import tool_specs

TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _parse(text: str, **kw: object) -> tuple[str, list[tuple[str, str]]]:
    settings = ToolSettings.from_request(
        tool_specs(["get_weather", "get_time"]), kw.get("tool_choice"), kw.get("parallel")  # type: ignore[arg-type]
    )
    parser = build_output_parser(tool_call_parser_name="hermes", reasoning_parser_name=None, tools=settings)
    if parser is None:
        return text, []
    out = parser.finish(text)
    return out.content, [(c.name, c.arguments) for c in parser.tool_calls]


def test_parallel_tool_calls_false_keeps_the_first_call_and_hides_the_rest() -> None:
    assert _parse(TWO_CALLS, parallel=False) == ("", [("get_weather", '{"city": "A"}')])
    assert len(_parse(TWO_CALLS)[1]) == 2


def test_tool_choice_none_turns_tool_parsing_off() -> None:
    assert _parse(TWO_CALLS, tool_choice="none") == (TWO_CALLS, [])


def test_named_tool_choice_accepts_only_that_function() -> None:
    content, calls = _parse(TWO_CALLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert calls == [("get_time", "{}")]
    assert content.startswith('<tool_call>{"name": "get_weather"')


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        (None, {"type": "function", "function": {"name": "f"}}, "tool_choice"),
        (tool_specs(["f"]), {"type": "function", "function": {"name": "g"}}, "tool_choice"),
        (tool_specs(["f"]), "sometimes", "tool_choice"),
        (tool_specs(["f"]), {"type": "function"}, "tool_choice"),
        ([{"type": "function", "function": {}}], "auto", "tools[0]"),
        (["get_weather"], "auto", "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "auto", "tools[0].type"),
    ],
)
def test_bad_tool_settings_are_400s_naming_the_parameter(tools: object, choice: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        ToolSettings.from_request(tools, choice, None)  # type: ignore[arg-type]
    assert info.value.param == param


def test_no_parser_when_nothing_to_parse() -> None:
    auto = ToolSettings.from_request(tool_specs(["f"]), None, None)
    assert build_output_parser(tool_call_parser_name=None, reasoning_parser_name=None, tools=auto) is None
    assert build_output_parser(tool_call_parser_name="hermes", reasoning_parser_name=None, tools=None) is None
    none = ToolSettings.from_request(tool_specs(["f"]), "none", None)
    assert build_output_parser(tool_call_parser_name="hermes", reasoning_parser_name=None, tools=none) is None
    # An unknown name (a card from a newer worker) is ignored, not a failure.
    assert build_output_parser(tool_call_parser_name="future_format", reasoning_parser_name="nope", tools=auto) is None


def test_finish_reason_length_stays_length() -> None:
    settings = ToolSettings.from_request(tool_specs(["get_weather", "get_time"]), None, None)
    parser = build_output_parser(tool_call_parser_name="hermes", reasoning_parser_name=None, tools=settings)
    assert parser is not None
    parser.finish(TWO_CALLS)
    assert parser.finish_reason("length") == "length" and parser.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize(
    ("text", "held"),
    [("abc", 0), ("abc<", 1), ("abc<tool_", 6), ("<tool_call", 10), ("<tool_call>", 0), ("a<b<tool", 5), ("", 0)],
)
def test_held_marker_len(text: str, held: int) -> None:
    assert held_marker_len(text, ("<tool_call>",)) == held


def test_detokenizer_keeps_only_the_special_tokens_a_parser_reads() -> None:
    tok = Tokenizer.from_dir(TINY_MODEL_DIR)
    python_tag = tok.token_to_id("<|python_tag|>")
    eot = tok.token_to_id("<|eot_id|>")
    assert python_tag in tok.special_token_ids and eot in tok.special_token_ids
    ids = [python_tag, *tok.encode('{"name": "f"}'), eot]
    plain = IncrementalDetokenizer(tok)
    kept = IncrementalDetokenizer(tok, keep_token_ids=frozenset({python_tag}))
    text_plain = "".join(plain.add_token(t) for t in ids) + plain.flush()
    text_kept = "".join(kept.add_token(t) for t in ids) + kept.flush()
    assert text_plain == '{"name": "f"}'
    assert text_kept == '<|python_tag|>{"name": "f"}'
