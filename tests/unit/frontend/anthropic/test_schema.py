"""The Messages API request: strict decoding that accepts Anthropic's documented fields, and its
translation into the chat request the pipeline serves."""

from __future__ import annotations

import json

import pytest

from dynamod.daemon.frontend.anthropic.convert import chat_messages, to_chat_request
from dynamod.daemon.frontend.anthropic.schema import decode_count_tokens_request, decode_messages_request
from dynamod.daemon.frontend.openai.sampling import sampling_options
from dynamod.daemon.frontend.preprocess.media.parts import WHERE_KEY
from dynamod.shared.errors import InvalidRequestError

USER = [{"role": "user", "content": "hi"}]


def _req(**fields: object) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 2048, "messages": USER, **fields}).encode()


def _refused(body: bytes, param: str, match: str | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        to_chat_request(decode_messages_request(body))
    assert info.value.param == param
    return info.value


def test_documented_fields_are_accepted() -> None:
    body = _req(
        system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        metadata={"user_id": "u-1"}, stop_sequences=["END"], temperature=0.3, top_p=0.9, top_k=40, stream=True,
        service_tier="auto", speed="standard", inference_geo="us", cache_control={"type": "ephemeral"},
        user_profile_id="p", workspace_id="w", thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
        output_config={"effort": "low"}, tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"},
                "strict": True}],
    )
    chat = to_chat_request(decode_messages_request(body))
    assert chat.messages[0] == {"role": "system", "content": "be brief"}
    assert chat.max_tokens == 2048 and chat.output_limit() == 2048 and chat.stream is True
    assert chat.stop_list() == ["END"] and chat.user == "u-1"
    assert (chat.temperature, chat.top_p, chat.top_k) == (0.3, 0.9, 40)
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "d"}}]
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    options = sampling_options(chat, logprobs=None)  # the chat pipeline's sampling accepts it as is
    assert options.temperature == 0.3 and options.top_k == 40


def test_strictness_names_the_parameter() -> None:
    with pytest.raises(InvalidRequestError, match="max_tokens") as info:
        decode_messages_request(json.dumps({"model": "m", "messages": USER}).encode())
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="use 'stop_sequences'") as info:
        decode_messages_request(_req(stop=["x"]))
    assert info.value.param == "stop"
    for field, value in (("temperature", 1.5), ("max_tokens", 0), ("top_k", -1)):
        with pytest.raises(InvalidRequestError) as info:
            decode_messages_request(_req(**{field: value}))
        assert info.value.param == field
    with pytest.raises(InvalidRequestError) as info:
        decode_messages_request(_req(thinking={"type": "enabled", "budget_tokens": 100}))
    assert info.value.param == "thinking.budget_tokens"
    with pytest.raises(InvalidRequestError) as info:
        decode_messages_request(_req(messages=[{"role": "user", "content": [{"type": "text", "txt": "x"}]}]))
    assert info.value.param == "messages[0].content[0].txt"


def test_multi_turn_blocks_become_chat_messages() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need a tool", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
            {"type": "text", "text": "so?"},
        ]},
    ]
    req = decode_count_tokens_request(json.dumps({"model": "m", "system": "sys", "messages": messages}).encode())
    assert chat_messages(req) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather\nin Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "need a tool", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "so?"},
    ]


def test_tool_choice_maps_to_the_chat_modes() -> None:
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
    cases = [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}, None),
        ({"type": "none"}, "none", None),
    ]
    for choice, chat_choice, parallel in cases:
        chat = to_chat_request(decode_messages_request(_req(tools=tools, tool_choice=choice)))
        assert (chat.tool_choice, chat.parallel_tool_calls) == (chat_choice, parallel), choice
    # A forced call is enforced the way OpenAI's is: the output is constrained to the tool's schema.
    forced = to_chat_request(decode_messages_request(_req(tools=tools, tool_choice={"type": "tool", "name": "f"})))
    guided = sampling_options(forced, logprobs=None).guided_decoding
    assert guided is not None and guided.json == tools[0]["input_schema"]
    unknown = to_chat_request(decode_messages_request(_req(tools=tools, tool_choice={"type": "tool", "name": "g"})))
    with pytest.raises(InvalidRequestError, match="'g'"):
        sampling_options(unknown, logprobs=None)


def test_image_blocks_become_image_parts_in_order_with_their_place() -> None:
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}}
    content = [{"type": "text", "text": "look"}, png, {"type": "text", "text": "and"}, url]
    chat = to_chat_request(decode_messages_request(_req(system="s", messages=[{"role": "user", "content": content}])))
    parts = chat.messages[1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text", "image_url"]
    assert parts[1]["image_url"] == {"url": "data:image/png;base64,iVBORw0KGgo="}
    assert parts[3]["image_url"] == {"url": "https://example.com/a.jpg"}
    # A bad image's 400 names the Anthropic block, not the chat message it became (system is [0]).
    assert [p.get(WHERE_KEY) for p in parts] == [None, "messages[0].content[1]", None, "messages[0].content[3]"]


def test_what_cannot_be_served_is_refused_by_name() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    _refused(_req(messages=[{"role": "user", "content": [result]}]), "messages[0].content[0].content[0]", "image")
    for source, field in (({"type": "base64", "media_type": "image/bmp", "data": "AA=="}, "media_type"),
                          ({"type": "base64", "media_type": "image/png", "data": ""}, "data"),
                          ({"type": "file", "file_id": "f-1"}, "'file'")):
        _refused(_req(messages=[{"role": "user", "content": [{"type": "image", "source": source}]}]),
                 "messages[0].content[0].source", field)
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    _refused(_req(messages=[{"role": "user", "content": [document]}]), "messages[0].content[0]", "document")
    _refused(_req(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0]", "Anthropic's servers")
    _refused(_req(tools=[{"name": "f"}]), "tools[0].input_schema")
    _refused(_req(messages=[*USER, {"role": "assistant", "content": "The answer is"}]), "messages[1]", "prefill")
    _refused(_req(container="c-1"), "container")
    _refused(_req(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}]), "mcp_servers")
    _refused(_req(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024}), "thinking.budget_tokens")
    _refused(_req(messages=[]), "messages")
    _refused(_req(stop_sequences=[str(i) for i in range(17)]), "stop_sequences")
    _refused(_req(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
             "messages[0].content[0]", "assistant")
