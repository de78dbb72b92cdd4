"""Every parser on recorded replies of its model family, fed whole, a character at a time, split
at every boundary into two pieces, and split at random (hypothesis): the content, reasoning and
tool calls must come out the same, and the stream must have OpenAI's shape (a call's id and name
in its first delta, only arguments after)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.frontend.parsers import OutputParser, ToolSettings, build_output_parser

from .recorded import MALFORMED, RECORDED, TOOLS, Recorded


def tool_specs(names: list[str] = TOOLS) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


def make_parser(case: Recorded, **tool_kw: object) -> OutputParser:
    settings_ = ToolSettings.from_request(tool_specs(), tool_kw.get("tool_choice"), tool_kw.get("parallel"))  # type: ignore[arg-type]
    parser = build_output_parser(
        tool_call_parser_name=case.tool_parser, reasoning_parser_name=case.reasoning_parser, tools=settings_
    )
    assert parser is not None
    return parser


@dataclass
class Streamed:
    content: str = ""
    reasoning: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [id, name, arguments]
    finish_reason: str | None = None

    def call_list(self) -> list[tuple[str, dict]]:
        return [(name, json.loads(args)) for _, (_, name, args) in sorted(self.calls.items())]


def run(case: Recorded, pieces: list[str], **tool_kw: object) -> Streamed:
    parser = make_parser(case, **tool_kw)
    out = Streamed()
    deltas = [parser.feed(p) for p in pieces[:-1]] + [parser.finish(pieces[-1] if pieces else "")]
    for d in deltas:
        out.content += d.content
        out.reasoning += d.reasoning
        for tc in d.tool_calls:
            if tc.index not in out.calls:
                assert tc.id and tc.name, f"first delta of call {tc.index} lacks id/name: {tc}"
                assert tc.index == len(out.calls), "calls are numbered in order"
                out.calls[tc.index] = [tc.id, tc.name, tc.arguments]
            else:
                assert tc.id is None and tc.name is None, "id and name come once, first"
                out.calls[tc.index][2] += tc.arguments
    out.finish_reason = parser.finish_reason("stop")
    # What was streamed is what the parser reports as whole calls.
    assert [(c.id, c.name, c.arguments) for c in parser.tool_calls] == [tuple(v) for _, v in sorted(out.calls.items())]
    return out


def check(case: Recorded, got: Streamed) -> None:
    assert got.content == case.content
    assert got.reasoning == case.reasoning
    assert got.call_list() == case.calls
    assert got.finish_reason == ("tool_calls" if case.calls else "stop")


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: c.name)
def test_whole_and_char_by_char(case: Recorded) -> None:
    check(case, run(case, [case.text]))
    check(case, run(case, list(case.text)))


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: c.name)
def test_every_two_piece_split(case: Recorded) -> None:
    for i in range(len(case.text) + 1):
        check(case, run(case, [case.text[:i], case.text[i:]]))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_splits(data: st.DataObject) -> None:
    case = data.draw(st.sampled_from(RECORDED))
    n = len(case.text)
    cuts = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=n), max_size=12)))
    bounds = [0, *cuts, n]
    check(case, run(case, [case.text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]))


@pytest.mark.parametrize("case", MALFORMED, ids=lambda c: c.name)
def test_malformed_call_is_content_in_one_pass(case: Recorded) -> None:
    got = run(case, [case.text])
    assert got.content == case.content and not got.calls and got.finish_reason == "stop"


@pytest.mark.parametrize("case", MALFORMED, ids=lambda c: c.name)
def test_malformed_call_never_fails_a_stream(case: Recorded) -> None:
    """Streamed, a call already announced cannot be taken back: it keeps what it got; one not yet
    sent comes back as content. Either way every character is accounted for once."""
    for i in range(len(case.text) + 1):
        got = run(case, [case.text[:i], case.text[i:]])
        if not got.calls:
            assert got.content == case.content
        else:
            assert len(got.calls) == 1 and got.calls[0][1] == "get_weather"
            assert not any(m in got.content for m in ("<tool_call>", "[TOOL_CALLS]", '{"name"')), got.content
