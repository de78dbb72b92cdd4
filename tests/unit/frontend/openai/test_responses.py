"""``/v1/responses`` through the real frontend in front of in-process workers on the real request
plane, driven by the official client (``responses.create``, ``stream=True``, ``responses.stream``):
the translation into a chat request, the output items and event sequence, the bounded store
behind ``previous_response_id``, and the seam that turns reasoning and function-call pieces into
their items."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from dynamod.daemon.frontend.openai.responses.endpoint import ResponsesWriter
from dynamod.daemon.frontend.openai.responses.output import (
    Piece,
    ReasoningPiece,
    ResponseBuilder,
    TextPiece,
    ToolCallPiece,
)
from dynamod.daemon.frontend.openai.responses.schema import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    decode_responses_request,
    input_messages,
    to_chat_request,
)
from dynamod.daemon.frontend.openai.responses.store import (
    PreviousResponseNotFoundError,
    ResponseStore,
    StoredResponse,
)
from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.errors import InvalidRequestError, NotFoundError
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.model_card import ModelCard, encode_card
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.test_app import CONTEXT, Cluster, client, expected_text, token_at

# ---- the translation ------------------------------------------------------------------------------


def test_input_items_become_chat_messages() -> None:
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "done"},
    ]
    for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": [{"type": "input_image"}]}],
                [{"type": "item_reference", "id": "x"}], ["text"], [{"type": "function_call", "name": "f"}]):
        with pytest.raises(InvalidRequestError) as info:
            input_messages(bad)
        assert info.value.param == "input"


def test_tools_and_tool_choice() -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}, "strict": True}]
    assert chat_tools(tools) == [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": {"type": "object"}, "strict": True}}]
    with pytest.raises(InvalidRequestError, match="hosted"):
        chat_tools([{"type": "web_search"}])
    assert chat_tool_choice("required") == "required"
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    for bad in ("sometimes", {"type": "file_search"}):
        with pytest.raises(InvalidRequestError):
            chat_tool_choice(bad)


def test_chat_request_carries_instructions_history_and_settings() -> None:
    req = ResponsesRequest(model="m", input="now", instructions="sys", max_output_tokens=5, temperature=0.5, ignore_eos=True)
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    chat = to_chat_request(req, history)
    assert chat.messages == [{"role": "system", "content": "sys"}, *history, {"role": "user", "content": "now"}]
    assert chat.turn_messages == [{"role": "user", "content": "now"}]  # stored without the instructions
    assert chat.output_limit() == 5 and chat.temperature == 0.5 and chat.wants_ignore_eos and chat.responses is req


def test_unsupported_requests_are_refused_by_name() -> None:
    cases = {
        "background": {"background": True}, "conversation": {"conversation": "conv_1"}, "prompt": {"prompt": {"id": "p"}},
        "truncation": {"truncation": "auto"}, "include": {"include": ["message.output_text.logprobs"]},
        "top_logprobs": {"top_logprobs": 3}, "text.format.type": {"text": {"format": {"type": "xml"}}},
    }
    for param, extra in cases.items():
        with pytest.raises(InvalidRequestError) as info:
            decode_responses_request(json.dumps({"model": "m", "input": "x", **extra}).encode())
        assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        decode_responses_request(b'{"model": "m", "input": "x", "max_output_tokens": 0}')
    assert info.value.param == "max_output_tokens"


# ---- the store ------------------------------------------------------------------------------------


def _entry(text: str, previous: str | None) -> StoredResponse:
    return StoredResponse({"id": text}, [{"role": "user", "content": text}], previous)


def test_store_rebuilds_chains_and_stays_bounded() -> None:
    store = ResponseStore(3)
    store.put("a", _entry("a", None))
    store.put("b", _entry("b", "a"))
    store.put("c", _entry("c", "b"))
    assert [m["content"] for m in store.history("c")] == ["a", "b", "c"]  # touches a, b, c
    store.put("x", _entry("x", None))  # evicts the least recently used: a
    with pytest.raises(PreviousResponseNotFoundError, match="earlier turn 'a'"):
        store.history("c")
    with pytest.raises(PreviousResponseNotFoundError) as info:
        store.history("zzz")
    assert info.value.param == "previous_response_id" and info.value.http_status == 400
    assert store.get("x").response == {"id": "x"}
    store.delete("x")
    with pytest.raises(NotFoundError):
        store.get("x")
    off = ResponseStore(0)
    off.put("a", _entry("a", None))
    assert len(off) == 0
    with pytest.raises(PreviousResponseNotFoundError, match="--responses-store-size 0"):
        off.history("a")


# ---- the builder ----------------------------------------------------------------------------------


def test_builder_event_sequence_for_every_item_kind() -> None:
    b = ResponseBuilder("resp_1", 0, {"model": "m"}, emit=True)
    raw = b.start()
    raw += b.add([ReasoningPiece("think"), ReasoningPiece("ing")])
    raw += b.add([TextPiece("Hel"), TextPiece("lo")])
    raw += b.add([ToolCallPiece(0, name="f", call_id="call_1"), ToolCallPiece(0, arguments='{"a":'), ToolCallPiece(0, arguments="1}")])
    raw += b.add([ToolCallPiece(1, name="g", arguments="{}")])
    raw += b.finish("completed", {"total_tokens": 3})
    events = [json.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n") if block]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hello" and final["output"][2]["arguments"] == '{"a":1}'
    assert [i["output_index"] for i in events if i["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    assert b.output_messages() == [{
        "role": "assistant", "content": "Hello", "reasoning_content": "thinking",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                       {"id": final["output"][3]["call_id"], "type": "function", "function": {"name": "g", "arguments": "{}"}}],
    }]


# ---- through the frontend ---------------------------------------------------------------------------


class StopWorker:
    """Generates ``answer`` tokens then finishes with ``stop`` (or ``length`` at max_tokens first)."""

    def __init__(self, lease: Any, answer: int) -> None:
        self.lease = lease
        self.answer = answer
        self.requests: list[dict] = []

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.requests.append(body)
        prompt = body["token_ids"]
        limit = body["stop"]["max_tokens"]
        n = min(self.answer, limit)
        for i in range(n):
            out: dict[str, Any] = {"token_ids": [token_at(len(prompt) + i)]}
            if i == n - 1:
                out["finish_reason"] = "stop" if n == self.answer else "length"
                out["usage"] = {"prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": n}
            yield out


async def _add_stop_worker(c: Cluster, answer: int = 6) -> StopWorker:
    assert c.rt is not None
    lease = await c.rt.create_lease()
    worker = StopWorker(lease, answer)
    await c.serve(worker.handler, lease)
    return worker


def _prompt_text(worker: StopWorker, index: int = -1) -> str:
    return Tokenizer.from_dir(TINY_MODEL_DIR).decode(worker.requests[index]["token_ids"], skip_special_tokens=False)


async def test_unary_response_and_previous_response_id(cluster: Cluster) -> None:
    worker = await _add_stop_worker(cluster)
    api = client(cluster)
    first = await api.responses.create(model="tiny", input="hello there", instructions="be brief", metadata={"k": "v"})
    prompt_len = len(worker.requests[-1]["token_ids"])
    assert first.status == "completed" and first.id.startswith("resp_") and first.model == "tiny"
    assert first.output_text == expected_text(prompt_len, 6)
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.usage.input_tokens == prompt_len and first.usage.output_tokens == 6
    assert first.usage.total_tokens == prompt_len + 6
    assert first.instructions == "be brief" and first.metadata == {"k": "v"} and first.store is True
    assert "be brief" in _prompt_text(worker)

    second = await api.responses.create(model="tiny", input="and again", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.status == "completed"
    prompt = _prompt_text(worker)
    # The earlier turn (its input and its answer) is in the prompt; its instructions are not.
    assert prompt.index("hello there") < prompt.index(first.output_text) < prompt.index("and again")
    assert "be brief" not in prompt

    assert (await api.responses.retrieve(first.id)).output_text == first.output_text
    await api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:  # the chain lost its first turn
        await api.responses.create(model="tiny", input="more", previous_response_id=second.id)
    assert info.value.code == "previous_response_not_found"
    unstored = await api.responses.create(model="tiny", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unstored.id)


async def test_max_output_tokens_makes_it_incomplete(cluster: Cluster) -> None:
    await _add_stop_worker(cluster, answer=50)
    api = client(cluster)
    reply = await api.responses.create(model="tiny", input="long please", max_output_tokens=4)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 4 and reply.output[0].status == "incomplete"

    stream = await api.responses.create(model="tiny", input="long please", max_output_tokens=4, stream=True)
    events = [e async for e in stream]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


async def test_streaming_events_and_the_stream_helper(cluster: Cluster) -> None:
    worker = await _add_stop_worker(cluster, answer=7)
    api = client(cluster)
    stream = await api.responses.create(model="tiny", input="stream it", stream=True)
    events = [e async for e in stream]
    prompt_len = len(worker.requests[-1]["token_ids"])
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected_text(prompt_len, 7) == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 7

    async with api.responses.stream(model="tiny", input="helper") as helper:
        deltas = [e.delta async for e in helper if e.type == "response.output_text.delta"]
        final = await helper.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    # The streamed response is stored like a unary one.
    assert (await api.responses.retrieve(final.id)).output_text == final.output_text


class ScriptedSplitter:
    """Stands in for the reasoning and tool-call parsers: the first two deltas are reasoning, the
    rest answer text, and the end brings one function call in two pieces."""

    def __init__(self) -> None:
        self.fed = 0

    def feed(self, text: str) -> list[Piece]:
        self.fed += 1
        return [ReasoningPiece(text) if self.fed <= 2 else TextPiece(text)]

    def finish(self) -> list[Piece]:
        return [ToolCallPiece(0, name="get_weather", call_id="call_w", arguments='{"city":'),
                ToolCallPiece(0, arguments=' "Paris"}')]


async def test_reasoning_and_function_call_items_reach_the_client(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = await _add_stop_worker(cluster, answer=5)
    monkeypatch.setattr(ResponsesWriter, "splitter", lambda self: ScriptedSplitter())
    api = client(cluster)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    async with api.responses.stream(model="tiny", input="weather?", tools=tools) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert call.name == "get_weather" and call.call_id == "call_w" and json.loads(call.arguments) == {"city": "Paris"}
    assert final.tools[0].name == "get_weather"
    assert "get_weather" in _prompt_text(worker)  # the tool reached the chat template

    # The client runs the tool and answers; the next turn's prompt has the call and its output.
    await api.responses.create(
        model="tiny", previous_response_id=final.id, tools=tools,
        input=[{"type": "function_call_output", "call_id": "call_w", "output": "sunny, 21C"}],
    )
    prompt = _prompt_text(worker)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt and "sunny, 21C" in prompt


SCRIPTED_REPLY = (
    '<think>it may rain</think>Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)


class ScriptedWorker:
    """Answers every request with the tokens of ``SCRIPTED_REPLY``, one per frame, then ``stop``."""

    def __init__(self) -> None:
        self.ids = Tokenizer.from_dir(TINY_MODEL_DIR).encode(SCRIPTED_REPLY)

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        n = len(self.ids)
        for i, token in enumerate(self.ids):
            out: dict[str, Any] = {"token_ids": [token]}
            if i == n - 1:
                out["finish_reason"] = "stop"
                out["usage"] = {"prompt_tokens": len(body["token_ids"]), "cached_tokens": 0, "completion_tokens": n}
            yield out


async def test_the_models_parsers_make_reasoning_and_function_call_items(cluster: Cluster) -> None:
    """A model card naming a reasoning and a tool-call parser: the same parsers as chat's split the
    reply into a reasoning item, a message and a function call, unary and streamed."""
    assert cluster.rt is not None
    lease = await cluster.rt.create_lease()
    card = ModelCard(served_model_name="tiny", tokenizer_source=str(TINY_MODEL_DIR), context_length=CONTEXT,
                     kv_block_size=16, tool_call_parser="hermes", reasoning_parser="qwen3")
    await cluster.store.put(mdc_key("dynamo", "backend", "generate", lease.id), encode_card(card), lease)
    await cluster.rt.namespace().component("backend").endpoint("generate").serve(ScriptedWorker().handler, lease=lease, model="tiny")
    await cluster.wait(lambda: any(st == "ready" for _, st in cluster.worker_states("tiny")))
    api = client(cluster)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]

    unary = await api.responses.create(model="tiny", input="weather?", tools=tools)
    assert [o.type for o in unary.output] == ["reasoning", "message", "function_call"]
    assert unary.output[0].content[0].text == "it may rain" and unary.output_text == "Let me check. "
    assert unary.output[2].name == "get_weather" and json.loads(unary.output[2].arguments) == {"city": "Paris"}
    assert unary.status == "completed"

    async with api.responses.stream(model="tiny", input="weather?", tools=tools) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert json.loads(final.output[2].arguments) == {"city": "Paris"} and final.output_text == "Let me check. "
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    # Without tools the call's markup is the answer's text (tool-call parsing is off), reasoning still split.
    plain = await api.responses.create(model="tiny", input="weather?")
    assert [o.type for o in plain.output] == ["reasoning", "message"] and "<tool_call>" in plain.output_text


async def test_text_format_json_schema_constrains_decoding(cluster: Cluster) -> None:
    worker = await _add_stop_worker(cluster)
    api = client(cluster)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    reply = await api.responses.create(
        model="tiny", input="json please", text={"format": {"type": "json_schema", "name": "place", "schema": schema}}
    )
    assert reply.text.format.type == "json_schema"
    assert worker.requests[-1]["sampling"]["guided_decoding"]["json"] == schema  # it reached the engine
    with pytest.raises(openai.BadRequestError):  # a schema that is not one: refused before routing
        await api.responses.create(model="tiny", input="x", text={"format": {"type": "json_schema", "name": "p", "schema": 5}})
    assert len(worker.requests) == 1


async def test_bad_requests_are_400(cluster: Cluster) -> None:
    await _add_stop_worker(cluster)
    bodies: list[Any] = [
        {"model": "tiny"}, {"model": "tiny", "input": []}, {"model": "tiny", "input": 5},
        {"model": "tiny", "input": "x", "tools": [{"type": "web_search_preview"}]},
        {"model": "tiny", "input": "x", "previous_response_id": "resp_nope"},
        {"model": "tiny", "input": "x", "temperature": 9},
        {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"model": "tiny", "input": "word " * 2000},  # over the context
    ]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        for body in [*bodies, b"{", b"[]"]:
            kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
            resp = await raw.post("/v1/responses", **kw)
            assert resp.status_code == 400, (body, resp.status_code, resp.text)
            assert resp.json()["error"]["message"]
        assert (await raw.post("/v1/responses", json={"model": "nope", "input": "x"})).status_code == 404
        assert (await raw.get("/v1/responses/resp_unknown")).status_code == 404
