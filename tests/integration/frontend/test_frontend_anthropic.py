"""``/v1/messages`` end to end with the official ``anthropic`` client: a real frontend process with
an API key and a mocker worker (the tiny tokenizer's chat template), unary, streamed (event types
and order), forced tool use whose input validates against the tool's schema (the mocker samples
random tokens under the guided-decoding masks, so only the enforcement makes it valid), errors,
and the key presented as ``x-api-key`` or as a bearer token."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import WEATHER, LocalCluster, Proc

pytestmark = pytest.mark.timeout(120)

KEY = secrets.token_urlsafe(24)
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "Time in a zone", "input_schema": TIME},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
IGNORE_EOS = {"nvext": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root: Path = tmp_path_factory.mktemp("anthropic-cluster")
    c = LocalCluster(root, speedup=100.0)
    try:
        c.start_worker()
        c.env = {**c.env, "DYN_API_KEY": KEY}  # the frontend only: the worker has started
        frontend = c.start_frontend()
        wait_until(lambda: _ready(c, frontend), 60, interval=0.1, what="a ready worker behind the keyed frontend")
        yield c
    finally:
        c.stop()


def _ready(cluster: LocalCluster, frontend: Proc) -> bool:
    """The worker is ready (``/health`` names workers only to a caller with a key)."""
    assert frontend.alive(), frontend.log()
    try:
        body = httpx.get(cluster.url + "/health", headers={"x-api-key": KEY}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(w["status"] == "ready" for m in body.get("models", []) for w in m["workers"])


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key=KEY, max_retries=0, timeout=60)


def test_unary_and_count_tokens(api: anthropic.Anthropic) -> None:
    # This SDK release has no temperature/top_p/top_k arguments any more; the API still takes them.
    msg = api.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=USER,
                              metadata={"user_id": "tester"}, extra_body={**IGNORE_EOS, "temperature": 0.5, "top_k": 20})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 12
    counted = api.messages.count_tokens(model="tiny", system="Be brief.", messages=USER)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


def test_stream_event_types_and_order(api: anthropic.Anthropic, cluster: LocalCluster) -> None:
    events = list(api.messages.create(model="tiny", max_tokens=10, messages=USER, stream=True, extra_body=IGNORE_EOS))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10

    # On the wire: each frame's event line names its data's type, and a ping follows message_start.
    with httpx.stream("POST", cluster.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": "tiny", "max_tokens": 3, "messages": USER, "stream": True}) as resp:
        names = [line.removeprefix("event: ") for line in resp.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def _check_tool_use(message: anthropic.types.Message, only: str | None) -> None:
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and not [b for b in message.content if b.type == "text"]
    for block in uses:
        assert block.id.startswith("toolu_") and block.name in SCHEMAS and (only is None or block.name == only)
        jsonschema.validate(block.input, SCHEMAS[block.name])


def test_forced_tool_use_validates_against_the_schema(api: anthropic.Anthropic) -> None:
    for seed in range(3):
        named = api.messages.create(model="tiny", max_tokens=200, messages=USER, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 1.0},
                                    metadata={"user_id": f"s{seed}"})
        _check_tool_use(named, "get_weather")
    any_tool = api.messages.create(model="tiny", max_tokens=300, messages=USER, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    _check_tool_use(any_tool, None)
    assert len(any_tool.content) == 1
    with api.messages.stream(model="tiny", max_tokens=200, messages=USER, tools=TOOLS,
                             tool_choice={"type": "tool", "name": "get_time"}) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_message()
    assert "input_json" in kinds
    _check_tool_use(final, "get_time")


def test_errors_and_auth(api: anthropic.Anthropic, cluster: LocalCluster) -> None:
    with pytest.raises(anthropic.NotFoundError) as nf:
        api.messages.create(model="nope", max_tokens=4, messages=USER)
    assert nf.value.body["type"] == "error" and nf.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        api.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "messages[0].content[0]: images are not supported" in bad.value.body["error"]["message"]  # tiny: text only

    bearer = anthropic.Anthropic(base_url=cluster.url, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(model="tiny", max_tokens=2, messages=USER).usage.output_tokens >= 1
    wrong = anthropic.Anthropic(base_url=cluster.url, api_key="x" * 32, max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="tiny", max_tokens=2, messages=USER)
    assert denied.value.body["error"]["type"] == "authentication_error"
