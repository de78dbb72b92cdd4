"""``cache_control`` -> the pin on the preprocessed request: the prefix up to the last marked block
counted in prompt tokens after the chat template (system, message, tool and request-level marks),
its TTL, the OpenAI spelling ``nvext.cache_control``, the 400s naming the field, and Anthropic's
three-part usage split."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from dynamod.daemon.frontend.anthropic.blocks import make_usage
from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from tests.unit.frontend.anthropic.test_endpoint import WEATHER_TOOL, client
from tests.unit.frontend.test_app import Cluster

_tok = Tokenizer.from_dir(TINY_MODEL_DIR)


def decode(ids: list[int]) -> str:
    return _tok.decode(ids, skip_special_tokens=False)


def pinned_text(body: dict) -> str:
    pin = body["pin"]
    assert 0 < pin["num_tokens"] <= len(body["token_ids"])
    return decode(body["token_ids"][: pin["num_tokens"]])


async def test_a_marked_system_block_pins_the_system_prompt_and_not_the_turn(cluster: Cluster) -> None:
    worker = await cluster.add_worker()
    api = client(cluster)
    await api.messages.create(
        model="tiny", max_tokens=2,
        system=[{"type": "text", "text": "ALPHA rules", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "BRAVO notes"}],
        messages=[{"role": "user", "content": "CHARLIE question"}],
    )
    body = worker.requests[-1]
    text = pinned_text(body)
    assert "ALPHA rules" in text and "BRAVO" not in text and "CHARLIE" not in text
    assert body["pin"]["ttl_s"] == 300.0


async def test_the_last_marked_message_block_sets_the_prefix_and_its_ttl(cluster: Cluster) -> None:
    worker = await cluster.add_worker()
    api = client(cluster)
    await api.messages.create(
        model="tiny", max_tokens=2, system="SYS",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "first DELTA", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "reply ECHO", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
            {"role": "user", "content": "then FOXTROT"},
        ],
    )
    body = worker.requests[-1]
    text = pinned_text(body)
    assert "DELTA" in text and "ECHO" in text and "FOXTROT" not in text
    assert body["pin"]["ttl_s"] == 3600.0
    assert _tok.decode(body["token_ids"], skip_special_tokens=False).startswith(text)


async def test_request_level_mark_pins_the_whole_prompt_and_no_mark_pins_nothing(cluster: Cluster) -> None:
    worker = await cluster.add_worker()
    api = client(cluster)
    messages = [{"role": "user", "content": "GOLF"}]
    await api.messages.create(model="tiny", max_tokens=2, messages=messages, extra_body={"cache_control": {"type": "ephemeral"}})
    body = worker.requests[-1]
    assert body["pin"]["num_tokens"] == len(body["token_ids"])
    await api.messages.create(model="tiny", max_tokens=2, messages=messages)
    assert "pin" not in worker.requests[-1]


async def test_a_marked_tool_pins_a_true_prefix_of_the_prompt(cluster: Cluster) -> None:
    worker = await cluster.add_worker()
    api = client(cluster)
    tool = {**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}
    await api.messages.create(model="tiny", max_tokens=2, tools=[tool], messages=[{"role": "user", "content": "HOTEL"}])
    body = worker.requests[-1]
    assert "HOTEL" not in pinned_text(body)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "system[0].cache_control.ttl"),
        ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "persistent"}}]}, "system[0].cache_control.type"),
        ({"tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral", "ttl": 5}}]}, "tools[0].cache_control"),
    ],
)
async def test_bad_cache_control_is_a_400_naming_the_field(cluster: Cluster, extra: dict, param: str) -> None:
    await cluster.add_worker()
    api = client(cluster)
    with pytest.raises(anthropic.BadRequestError) as err:
        await api.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}], extra_body=extra)
    assert param in err.value.message


async def test_nvext_cache_control_pins_the_chat_prompt(cluster: Cluster) -> None:
    worker = await cluster.add_worker()
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "INDIA"}]}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=20) as http:
        r = await http.post("/v1/chat/completions", json={**chat, "nvext": {"cache_control": {"type": "ephemeral", "ttl": "30s"}}})
        assert r.status_code == 200, r.text
        body = worker.requests[-1]
        assert body["pin"] == {"num_tokens": len(body["token_ids"]), "ttl_s": 30.0}
        r = await http.post("/v1/chat/completions", json={**chat, "nvext": {"cache_control": {"prefix_tokens": 3}}})
        assert r.status_code == 200 and worker.requests[-1]["pin"] == {"num_tokens": 3, "ttl_s": 300.0}
        for ttl in ("90m", "5x", "0s", "m"):
            r = await http.post("/v1/chat/completions", json={**chat, "nvext": {"cache_control": {"ttl": ttl}}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "nvext.cache_control.ttl", ttl
        r = await http.post("/v1/chat/completions", json={**chat, "nvext": {"cache_control": {"prefix_tokens": 0}}})
        assert r.status_code == 400 and "nvext.cache_control.prefix_tokens" in r.text


def test_usage_splits_the_prompt_into_read_created_and_input():
    usage = make_usage(100, 5, cached_tokens=20, pinned_tokens=30)
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens, usage.input_tokens) == (20, 30, 50)
    assert make_usage(10, 1, cached_tokens=8, pinned_tokens=16).cache_creation_input_tokens == 2  # never past the prompt
