"""Pieces -> content blocks and Anthropic's exact event sequence; stop reasons and usage."""

from __future__ import annotations

import json

from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from dynamod.daemon.frontend.anthropic.blocks import MessageBuilder, make_usage, stop_reason
from dynamod.daemon.frontend.anthropic.schema import encoder
from dynamod.daemon.frontend.pipeline.pieces import ReasoningPiece, TextPiece, ToolCallPiece

_EVENTS = TypeAdapter(RawMessageStreamEvent)


def _events(raw: bytes) -> list[dict]:
    """Parsed SSE events; each event line names the type its data carries."""
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == "event: " + data["type"]
        out.append(data)
    return out


def _stream(builder: MessageBuilder) -> bytes:
    raw = builder.start(make_usage(30, 1, 10))
    raw += builder.add([ReasoningPiece("let me "), ReasoningPiece("think")])
    raw += builder.add([TextPiece("Checking"), TextPiece(".")])
    raw += builder.add([ToolCallPiece(0, name="get_weather", call_id="call_a", arguments='{"city":'),
                        ToolCallPiece(0, arguments=' "Oslo"}')])
    raw += builder.add([ToolCallPiece(1, name="get_time", call_id="call_b", arguments="{}")])
    raw += builder.finish(stop_reason("stop", None, builder.has_tool_use), None, make_usage(30, 12, 10))
    return raw


def test_the_event_sequence_is_anthropics() -> None:
    events = _events(_stream(MessageBuilder("msg_1", "tiny", emit=True)))
    kinds = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    assert kinds == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]
    for event in events:  # every event (but ping, which the client skips) is one of the client's types
        if event["type"] != "ping":
            _EVENTS.validate_python(event)
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert start["usage"] == {"input_tokens": 20, "output_tokens": 1, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 10}
    assert events[10]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 12


def test_unary_message_has_the_same_blocks() -> None:
    builder = MessageBuilder("msg_2", "tiny", emit=False)
    assert _stream(builder) == b""  # nothing encoded for a unary request
    message = builder.message("tool_use", None, make_usage(30, 12, 0))
    body = json.loads(encoder.encode(message))
    SdkMessage.model_validate(body)
    assert body["type"] == "message" and body["id"] == "msg_2" and body["role"] == "assistant"
    assert body["content"] == [
        {"type": "thinking", "thinking": "let me think", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {}},
    ]


def test_omitted_thinking_keeps_the_block_empty() -> None:
    builder = MessageBuilder("msg_3", "tiny", emit=True, show_thinking=False)
    events = _events(builder.add([ReasoningPiece("secret"), TextPiece("answer")]))
    assert [e["type"] for e in events] == ["content_block_start", "content_block_stop", "content_block_start",
                                           "content_block_delta"]
    assert "secret" not in json.dumps(events)
    assert builder.message("end_turn", None, make_usage(1, 1, 0)).content[0].thinking == ""


def test_stop_reasons_and_cut_tool_input() -> None:
    assert stop_reason("length", None, True) == "max_tokens"
    assert stop_reason("stop", "END", False) == "stop_sequence"
    assert stop_reason("stop", None, True) == "tool_use"
    assert stop_reason("stop", None, False) == "end_turn"
    builder = MessageBuilder("msg_4", "tiny", emit=False)
    builder.add([ToolCallPiece(0, name="f", arguments='{"a": ')])  # cut by max_tokens: no id from the parser
    block = builder.message("max_tokens", None, make_usage(1, 1, 0)).content[0]
    assert block.input == {} and block.id == "toolu_4_0"


def test_error_event_is_the_error_body() -> None:
    builder = MessageBuilder("msg_5", "tiny", emit=True)
    (event,) = _events(builder.fail("overloaded_error", "no worker", "req_5"))
    assert event == {"type": "error", "error": {"type": "overloaded_error", "message": "no worker"}, "request_id": "req_5"}
