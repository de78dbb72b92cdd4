"""``/v1/messages`` and ``/v1/messages/count_tokens`` in-process (the real HTTP server, fake
workers on the real request plane) driven by the official ``anthropic`` client: text, thinking
and tool use from the model card's parsers, stop sequences, usage, the event sequence, and errors
at the door, before the first token and in-band."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from dynamod.daemon.frontend.app import build_app
from dynamod.daemon.frontend.http.auth import ApiKeys
from dynamod.daemon.frontend.http.request_checks import DoorSettings
from dynamod.daemon.frontend.http.server import HttpServer, bind_socket
from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.model_card import ModelCard, encode_card
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.openai.test_responses import ScriptedWorker
from tests.unit.frontend.test_app import CONTEXT, Cluster, expected_text

USER = [{"role": "user", "content": "hello there"}]
WEATHER_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(c: Cluster, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=c.url, api_key=kw.pop("api_key", "none"), max_retries=0, timeout=20, **kw)


def _prompt_text(body: dict) -> str:
    return Tokenizer.from_dir(TINY_MODEL_DIR).decode(body["token_ids"], skip_special_tokens=False)


async def _raw_events(c: Cluster, body: dict, headers: dict[str, str] | None = None) -> list[tuple[str, dict]]:
    """The SSE frames as sent, ping included (the client's iterator skips pings)."""
    events = []
    async with httpx.AsyncClient(timeout=20) as http, http.stream(
        "POST", c.url + "/v1/messages", json={**body, "stream": True}, headers=headers or {}
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
        assert resp.headers["request-id"].startswith("req_")
        name = None
        async for line in resp.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append((name, data))
    return events


async def test_unary_stream_and_count_tokens(cluster: Cluster) -> None:
    worker = await cluster.add_worker(cached_tokens=4)
    api = client(cluster)
    msg = await api.messages.create(model="tiny", max_tokens=6, system="be brief", messages=USER,
                                    metadata={"user_id": "u1"}, extra_body={"top_k": 5})
    prompt_len = len(worker.requests[-1]["token_ids"])
    assert "be brief" in _prompt_text(worker.requests[-1]) and "hello there" in _prompt_text(worker.requests[-1])
    assert worker.requests[-1]["sampling"]["top_k"] == 5
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == expected_text(prompt_len, 6)
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.input_tokens == prompt_len - 4 and msg.usage.cache_read_input_tokens == 4
    assert msg.usage.output_tokens == 6

    counted = await api.messages.count_tokens(model="tiny", system="be brief", messages=USER)
    assert counted.input_tokens == prompt_len

    events = await _raw_events(cluster, {"model": "tiny", "max_tokens": 5, "system": "be brief", "messages": USER})
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == expected_text(prompt_len, 5)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5 and delta["usage"]["cache_read_input_tokens"] == 4

    async with api.messages.stream(model="tiny", max_tokens=5, system="be brief", messages=USER) as stream:
        streamed = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert streamed == final.content[0].text == text and final.stop_reason == "max_tokens"


async def test_stop_sequences_end_the_message(cluster: Cluster) -> None:
    worker = await cluster.add_worker()
    api = client(cluster)
    await api.messages.create(model="tiny", max_tokens=1, messages=USER)
    full = expected_text(len(worker.requests[-1]["token_ids"]), 12)
    stop = full[6:9]
    msg = await api.messages.create(model="tiny", max_tokens=12, messages=USER, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == full[: full.index(stop)]


async def _add_scripted_worker(c: Cluster) -> ScriptedWorker:
    """A worker whose card names the hermes tool-call and qwen3 reasoning parsers; it answers
    ``<think>it may rain</think>Let me check. <tool_call>{get_weather Paris}</tool_call>``."""
    assert c.rt is not None
    lease = await c.rt.create_lease()
    card = ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR), context_length=CONTEXT,
                     kv_block_size=16, tool_call_parser="hermes", reasoning_parser="qwen3")
    await c.store.put(mdc_key("dynamo", "backend", "generate", lease.id), encode_card(card), lease)
    worker = ScriptedWorker()
    seen: list[dict] = []

    async def handler(body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        seen.append(body)
        async for out in worker.handler(body, ctx):
            yield out

    worker.requests = seen  # type: ignore[attr-defined]
    await c.rt.namespace().component("backend").endpoint("generate").serve(handler, lease=lease, model="tiny")
    await c.wait(lambda: any(st == "ready" for _, st in c.worker_states("tiny")))
    return worker


async def test_thinking_text_and_tool_use_from_the_models_parsers(cluster: Cluster) -> None:
    worker = await _add_scripted_worker(cluster)
    api = client(cluster)
    # (``enabled`` needs a budget of 1024 and more max_tokens than this tiny context holds)
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 256, "messages": [{"role": "user", "content": "weather?"}],
                          "tools": [WEATHER_TOOL], "thinking": {"type": "adaptive"}}
    msg = await api.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "it may rain" and msg.content[1].text == "Let me check. "
    call = msg.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    assert msg.stop_reason == "tool_use"
    assert "get_weather" in _prompt_text(worker.requests[-1])  # type: ignore[attr-defined]

    async with api.messages.stream(**kw) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert {"thinking", "text", "input_json"} <= set(kinds)

    # The client runs the tool and answers: the next prompt holds the call and its result.
    await api.messages.create(model="tiny", max_tokens=16, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}]},
    ])
    prompt = _prompt_text(worker.requests[-1])  # type: ignore[attr-defined]
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt and "sunny, 21C" in prompt


async def test_errors_have_anthropics_shape(cluster: Cluster) -> None:
    await cluster.add_worker()
    api = client(cluster)
    with pytest.raises(anthropic.NotFoundError) as nf:
        await api.messages.create(model="nope", max_tokens=4, messages=USER)
    assert nf.value.body["error"]["type"] == "not_found_error" and nf.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        await api.messages.create(model="tiny", max_tokens=4, messages=USER, extra_body={"stop": ["x"]})
    assert "stop_sequences" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as ctx:  # the context check, after planning
        await api.messages.create(model="tiny", max_tokens=CONTEXT, messages=USER)
    assert ctx.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        await api.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    async with httpx.AsyncClient() as http:
        wrong_method = await http.get(cluster.url + "/v1/messages")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_a_failure_after_the_start_is_an_error_event(cluster: Cluster) -> None:
    assert cluster.rt is not None
    lease = await cluster.rt.create_lease()
    card = ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR), context_length=CONTEXT, kv_block_size=16)
    await cluster.store.put(mdc_key("dynamo", "backend", "generate", lease.id), encode_card(card), lease)

    async def failing(body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        yield {"token_ids": [300, 301]}
        yield {"token_ids": [], "finish_reason": "error", "error": "the GPU fell over"}

    await cluster.rt.namespace().component("backend").endpoint("generate").serve(failing, lease=lease, model="tiny")
    await cluster.wait(lambda: any(st == "ready" for _, st in cluster.worker_states("tiny")))
    events = await _raw_events(cluster, {"model": "tiny", "max_tokens": 8, "messages": USER})
    assert [n for n, _ in events][:2] == ["message_start", "ping"]
    name, error = events[-1]
    assert name == "error" and error["error"]["type"] == "api_error" and "GPU fell over" in error["error"]["message"]
    with pytest.raises(anthropic.APIStatusError):
        async with client(cluster).messages.stream(model="tiny", max_tokens=8, messages=USER) as stream:
            async for _ in stream:
                pass


async def test_x_api_key_and_bearer_both_authenticate(cluster: Cluster) -> None:
    await cluster.add_worker()
    assert cluster.state is not None
    key = "k" * 24
    server = HttpServer(build_app(cluster.state, DoorSettings(api_keys=ApiKeys([key]))), bind_socket("127.0.0.1", 0),
                        graceful_s=1.0)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        by_header = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=20)
        assert (await by_header.messages.create(model="tiny", max_tokens=2, messages=USER)).usage.output_tokens == 2
        by_bearer = anthropic.AsyncAnthropic(base_url=url, auth_token=key, max_retries=0, timeout=20)
        assert (await by_bearer.messages.count_tokens(model="tiny", messages=USER)).input_tokens > 0
        wrong = anthropic.AsyncAnthropic(base_url=url, api_key="w" * 24, max_retries=0, timeout=20)
        with pytest.raises(anthropic.AuthenticationError) as info:
            await wrong.messages.create(model="tiny", max_tokens=2, messages=USER)
        assert info.value.body["error"]["type"] == "authentication_error"
        async with httpx.AsyncClient() as http:  # the OpenAI routes take x-api-key too, in their own shape
            resp = await http.post(url + "/v1/chat/completions", headers={"x-api-key": key},
                                   json={"model": "tiny", "messages": USER, "max_tokens": 2})
            assert resp.status_code == 200
            resp = await http.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": USER})
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    finally:
        await server.stop()
