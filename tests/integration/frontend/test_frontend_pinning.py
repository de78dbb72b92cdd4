"""Pinned prefixes end to end with the official ``anthropic`` client: a real frontend and a mocker
worker with a small KV cache (64 blocks of 16 tokens, pins bounded to half of it). A system prompt
marked with ``cache_control`` is pinned (``cache_creation_input_tokens``); a storm of other prompts
cycles the cache; the pinned prefix is then read back from the cache (``cache_read_input_tokens``)
while an unpinned one of the same size is gone. A pin past the bound is refused: the request runs,
nothing is created, and the frontend's metric says so."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.integration.frontend.test_frontend_support import LocalCluster

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
IGNORE_EOS = {"nvext": {"ignore_eos": True}}


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


PINNED_SYSTEM = words("apple", 50)  # ~150 tokens: 9 whole blocks
UNPINNED_SYSTEM = words("pear", 50)
TOO_BIG_SYSTEM = words("zebra", 100)  # ~500 tokens: more blocks than the bound has left


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root: Path = tmp_path_factory.mktemp("pinning-cluster")
    c = LocalCluster(root, speedup=100.0)
    try:
        c.start_worker("--num-gpu-blocks", "64", "--block-size", str(BLOCK), "--max-pinned-fraction", "0.5")
        c.start_frontend()
        c.wait_ready(1)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key="none", max_retries=0, timeout=30)


def ask(api: anthropic.Anthropic, system: str, question: str, *, pin: bool) -> anthropic.types.Usage:
    block: dict = {"type": "text", "text": system}
    if pin:
        block["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    msg = api.messages.create(model="tiny", max_tokens=2, system=[block], messages=[{"role": "user", "content": question}],
                              extra_body=IGNORE_EOS)
    assert msg.usage.output_tokens == 2
    return msg.usage


def pin_counts(cluster: LocalCluster) -> dict[str, float]:
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    pattern = r'dynamo_frontend_prefix_pins_total\{model="tiny",outcome="(\w+)"\} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}


def test_a_pinned_prefix_survives_a_storm_that_evicts_an_unpinned_one(api: anthropic.Anthropic, cluster: LocalCluster) -> None:
    first = ask(api, PINNED_SYSTEM, "question one", pin=True)
    assert first.cache_creation_input_tokens >= 8 * BLOCK and first.cache_creation_input_tokens % BLOCK == 0
    assert first.cache_read_input_tokens == 0
    unpinned = ask(api, UNPINNED_SYSTEM, "question one", pin=False)
    assert unpinned.cache_creation_input_tokens == 0
    assert ask(api, UNPINNED_SYSTEM, "question two", pin=False).cache_read_input_tokens >= 8 * BLOCK  # cached, for now

    # ~16 blocks each, 10 of them: the 55 unpinned blocks are cycled nearly three times.
    for k in range(10):
        ask(api, words(f"storm{k}x", 60), "go", pin=False)

    again = ask(api, PINNED_SYSTEM, "question two", pin=False)
    assert again.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert again.cache_creation_input_tokens == 0
    gone = ask(api, UNPINNED_SYSTEM, "question three", pin=False)
    assert gone.cache_read_input_tokens == 0

    refused = ask(api, TOO_BIG_SYSTEM, "question one", pin=True)  # the bound (32 blocks) has ~23 left
    assert refused.cache_creation_input_tokens == 0
    counts = pin_counts(cluster)
    assert counts.get("created") == 1.0 and counts.get("refused") == 1.0, counts


def test_nvext_cache_control_pins_a_chat_prompt(cluster: LocalCluster) -> None:
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": words("kiwi", 40)}],
            "nvext": {"ignore_eos": True, "cache_control": {"type": "ephemeral", "ttl": "30m"}}}
    first = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30).json()["usage"]
    created = first["prompt_tokens_details"]["created_cache_tokens"]
    assert created >= 6 * BLOCK and created % BLOCK == 0 and first["prompt_tokens_details"]["cached_tokens"] == 0
    for k in range(10):  # the same storm as above, with other prompts
        httpx.post(cluster.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": words(f"gust{k}x", 60)}]})
    del body["nvext"]["cache_control"]
    again = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= created
    assert "created_cache_tokens" not in again["prompt_tokens_details"]  # no pin asked for
