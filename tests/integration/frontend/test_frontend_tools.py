"""Tool calls and reasoning through the real frontend, with the official ``openai`` client and an
agent framework (the OpenAI Agents SDK) driving a two-step tool loop.

The frontend runs in-process with its real HTTP server, tokenizer, chat template, router and
request plane (``Cluster`` from the frontend app tests). The worker is scripted: a real endpoint
on the request plane that decodes the prompt it is sent, picks the reply a model of the family
would write (a tool call while the conversation lacks its result, the answer once it has it),
and streams that reply's token ids one per frame. So everything between the HTTP request and the
response runs as in production: template -> tokens -> route -> worker -> detokenize -> parse ->
OpenAI format. The mocker samples random tokens, which is why a scripted worker stands in for it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest

from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.model_card import ModelCard, encode_card
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.test_app import CONTEXT, Cluster

TOKENIZER = Tokenizer.from_dir(TINY_MODEL_DIR)
EOT = TOKENIZER.token_to_id("<|eot_id|>")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def llama_reply(prompt: str) -> str:
    """What a Llama 3.1-style reasoning model writes for the conversation ``prompt``."""
    if "MALFORMED" in prompt:
        return '{"name": "get_weather", "parameters": {"city": }}'
    if "TWO AT ONCE" in prompt:
        return '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {"city": "Oslo"}}'
    if "get_weather" not in prompt:  # no tools offered: think, then answer
        return "<think>A greeting; answer kindly.</think>\n\nHello from dynamod!"
    if "TIME=" in prompt:
        weather = prompt.split("WEATHER=", 1)[1].split("<|eot_id|>", 1)[0]
        time = prompt.split("TIME=", 1)[1].split("<|eot_id|>", 1)[0]
        return f"<think>I have both.</think>\n\nIn Paris it is {weather} and the time is {time}."
    if "WEATHER=" in prompt:
        return '<think>Now the time.</think>\n<|python_tag|>{"name": "get_time", "parameters": {"city": "Paris"}}'
    return '<think>The user wants the weather in Paris; get_weather does that.</think>\n\n{"name": "get_weather", "parameters": {"city": "Paris", "note": "tiles {a} \\"b\\""}}'


class ScriptedWorker:
    """A worker endpoint that replies with ``script(prompt text)``, one token per frame, then EOS."""

    def __init__(self, script: Callable[[str], str]) -> None:
        self.script = script
        self.prompts: list[str] = []

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        prompt = TOKENIZER.decode(body["token_ids"], skip_special_tokens=False)
        self.prompts.append(prompt)
        reply = [*TOKENIZER.encode(self.script(prompt)), EOT]
        max_tokens = body["stop"]["max_tokens"]
        ids = reply[:max_tokens]
        for i, token in enumerate(ids):
            out: dict[str, Any] = {"token_ids": [token]}
            if i == len(ids) - 1:
                out["finish_reason"] = "stop" if len(ids) == len(reply) else "length"
                out["usage"] = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(ids)}
            yield out


async def add_scripted(c: Cluster, model: str, script: Callable[[str], str], **card_fields: Any) -> ScriptedWorker:
    assert c.rt is not None
    lease = await c.rt.create_lease()
    worker = ScriptedWorker(script)
    card = ModelCard(
        served_model_name=model, tokenizer_source=str(TINY_MODEL_DIR), context_length=CONTEXT * 4, kv_block_size=16,
        **card_fields,
    )
    await c.store.put(mdc_key("dynamo", "backend", "generate", lease.id), encode_card(card), lease)
    await c.rt.namespace().component("backend").endpoint("generate").serve(worker.handler, lease=lease, model=model)
    await c.wait(lambda: any(s == "ready" for _, s in c.worker_states(model)))
    return worker


@pytest.fixture
async def tools_cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    await c.start()
    try:
        await add_scripted(c, "llama-tools", llama_reply, tool_call_parser="llama3_json", reasoning_parser="basic")
        await add_scripted(c, "llama-plain", llama_reply)
        yield c
    finally:
        await c.stop()


def api(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=20)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_unary_tool_call_with_reasoning(tools_cluster: Cluster) -> None:
    resp = await api(tools_cluster).chat.completions.create(model="llama-tools", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather in Paris; get_weather does that."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "note": 'tiles {a} "b"'}


async def test_streamed_tool_call_id_and_name_first_then_arguments_in_pieces(tools_cluster: Cluster) -> None:
    stream = await api(tools_cluster).chat.completions.create(
        model="llama-tools", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], stream=True
    )
    content, reasoning, pieces, firsts, finish = "", "", [], [], None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.id is not None:
                firsts.append((tc.id, tc.type, tc.function.name))
            if tc.function.arguments:
                pieces.append(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and "<think>" not in reasoning and "{" not in content
    assert reasoning == "The user wants the weather in Paris; get_weather does that."
    assert len(firsts) == 1 and firsts[0][1:] == ("function", "get_weather")
    assert len(pieces) > 3, "arguments arrive in pieces as the tokens do"
    assert json.loads("".join(pieces)) == {"city": "Paris", "note": 'tiles {a} "b"'}
    assert finish == "tool_calls"


async def test_special_token_marker_and_parallel_calls(tools_cluster: Cluster) -> None:
    """``<|python_tag|>`` is a special token of the tiny tokenizer: it reaches the parser, not the client."""
    client = api(tools_cluster)
    msgs = [{"role": "user", "content": "TWO AT ONCE please"}]
    resp = await client.chat.completions.create(model="llama-tools", messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL])
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in resp.choices[0].message.tool_calls}) == 2
    single = await client.chat.completions.create(
        model="llama-tools", messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False, stream=True
    )
    names = [tc.function.name async for ch in single for tc in (ch.choices[0].delta.tool_calls or []) if tc.function.name]
    assert names == ["get_weather"]


async def test_tool_choice_none_and_malformed_calls_are_content(tools_cluster: Cluster) -> None:
    client = api(tools_cluster)
    resp = await client.chat.completions.create(model="llama-tools", messages=ASK, tools=[WEATHER_TOOL], tool_choice="none")
    msg = resp.choices[0].message
    assert msg.tool_calls is None and resp.choices[0].finish_reason == "stop"
    assert msg.content.startswith('{"name": "get_weather"')  # reasoning still split off
    bad = [{"role": "user", "content": "MALFORMED"}]
    resp = await client.chat.completions.create(model="llama-tools", messages=bad, tools=[WEATHER_TOOL])
    assert resp.choices[0].message.content == '{"name": "get_weather", "parameters": {"city": }}'
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "stop"
    # Streamed, the call was announced (id, name, argument pieces) before its end showed it broken:
    # what is sent stays sent, so the stream ends normally with the arguments the model wrote.
    chunks = [c async for c in await client.chat.completions.create(
        model="llama-tools", messages=bad, tools=[WEATHER_TOOL], stream=True)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    args = "".join(tc.function.arguments or "" for c in chunks for tc in (c.choices[0].delta.tool_calls or []))
    assert args == '{"city": }' and chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_reasoning_without_tools_and_models_without_parsers(tools_cluster: Cluster) -> None:
    client = api(tools_cluster)
    hi = [{"role": "user", "content": "hi"}]
    resp = await client.chat.completions.create(model="llama-tools", messages=hi)
    assert resp.choices[0].message.content == "Hello from dynamod!"
    assert resp.choices[0].message.model_extra["reasoning_content"] == "A greeting; answer kindly."
    chunks = [c async for c in await client.chat.completions.create(model="llama-tools", messages=hi, stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello from dynamod!"
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks) == "A greeting; answer kindly."
    # A card without parsers: the text is content, as it comes; no reasoning_content key at all.
    async with httpx.AsyncClient(base_url=tools_cluster.url) as http:
        body = (await http.post("/v1/chat/completions", json={"model": "llama-plain", "messages": hi})).json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>A greeting; answer kindly.</think>\n\nHello from dynamod!"}


async def test_bad_tool_choice_is_a_400(tools_cluster: Cluster) -> None:
    client = api(tools_cluster)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="llama-tools", messages=ASK, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="llama-plain", messages=ASK, tool_choice="required")


async def test_agents_sdk_completes_a_two_step_tool_loop(tools_cluster: Cluster) -> None:
    import agents  # openai-agents (test extra): a maintained agent framework using function calling

    agents.set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    called: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(("get_weather", city))
        return "WEATHER=21C and sunny"

    @agents.function_tool
    def get_time(city: str) -> str:
        """Local time in a city."""
        called.append(("get_time", city))
        return "TIME=12:00"

    for stream in (False, True):
        called.clear()
        model = agents.OpenAIChatCompletionsModel(model="llama-tools", openai_client=api(tools_cluster))
        agent = agents.Agent(name="assistant", instructions="Use the tools.", tools=[get_weather, get_time], model=model)
        if stream:
            run = agents.Runner.run_streamed(agent, "What is the weather and the time in Paris?")
            async for _ in run.stream_events():
                pass
            final = run.final_output
        else:
            final = (await agents.Runner.run(agent, "What is the weather and the time in Paris?")).final_output
        assert called == [("get_weather", "Paris"), ("get_time", "Paris")]
        assert final == "In Paris it is 21C and sunny and the time is 12:00."
