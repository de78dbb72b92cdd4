"""Real vLLM (CPU build) behind the real frontend, end to end.

One cluster for the module: two ``dynamod --role agg --engine vllm`` workers hosting the tiny
random-weight Llama (scripts/make_tiny_llama.py) and a frontend with KV routing, all real
processes on file discovery and ZMQ events. The test keeps its own copy of the router's index, fed
from the workers' ``kv-events`` exactly as the frontend's router is, to see what vLLM's native
events put there.

Needs the vLLM environment (scripts/setup_vllm_env.sh); skipped without it. Engine start is 20-45 s
per worker on 2 cores, so everything shares one cluster and each test leaves it as it found it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import openai
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.kv.hashing import compute_block_hashes
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import RouterEvent, router_event_decoder
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import wait_until
from tests.integration.engines.test_vllm_support import (
    ENGINE_START_TIMEOUT_S,
    VllmCluster,
    build_tiny_model,
    vllm_marks,
    vllm_python,
)
from tests.integration.frontend.test_frontend_support import get_json, get_text

VLLM_PYTHON = vllm_python()
pytestmark = vllm_marks(VLLM_PYTHON)

BLOCK = 32
MODEL = "tinyllama"
LORA = "tiny-lora"
# --scheduling-policy priority: requests carry their priority to vLLM (issue 27); priority 0 is FCFS.
VLLM_ARGS = (
    f"--block-size {BLOCK} --enforce-eager --max-model-len 4096 --enable-lora --max-lora-rank 8 --max-loras 2 "
    "--scheduling-policy priority"
)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm")
    model, lora = root / MODEL, root / "lora"
    build_tiny_model(model, lora_out=lora)
    return {"root": root, "model": model, "lora": lora}


@pytest.fixture(scope="module")
def cluster(paths: dict[str, Path]) -> Iterator[VllmCluster]:
    assert VLLM_PYTHON is not None
    c = VllmCluster(paths["root"], VLLM_PYTHON, paths["model"])
    try:
        # LoRA sources must lie under a --lora-root (issue 25): the adapter is built beside the model.
        c.env["DYN_LORA_ROOT"] = str(paths["lora"].parent)
        c.start_worker(VLLM_ARGS)
        c.start_worker(VLLM_ARGS)
        c.start_frontend("--router-mode", "kv")
        wait_until(lambda: _ready(c, 2), ENGINE_START_TIMEOUT_S, interval=0.5, what="two ready vLLM workers")
        yield c
    finally:
        c.stop()


def _ready(c: VllmCluster, count: int) -> list[str] | None:
    for proc in c.workers:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
    try:
        body = get_json(c.url + "/health")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    for m in body.get("models", []):
        if m["model"] == MODEL:
            ready = [w["instance_id"] for w in m["workers"] if w["status"] == "ready"]
            return ready if len(ready) >= count else None
    return None


@pytest.fixture
def api(cluster: VllmCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture
async def observer(cluster: VllmCluster) -> AsyncIterator[Observer]:
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(cluster.file_kv), event_plane="zmq",
                               lease_ttl_s=cluster.lease_ttl)
    rt = await DistributedRuntime.create(settings)
    obs = Observer(rt)
    try:
        await obs.start()
        yield obs
    finally:
        await obs.close()
        await rt.shutdown(1)


class Observer:
    """The test's view of the workers: a router index fed by their kv-events, and control calls."""

    def __init__(self, rt: DistributedRuntime) -> None:
        self.rt = rt
        self.comp = rt.namespace().component("backend")
        self.index = KvIndexer()
        self.events = 0
        self._task: asyncio.Task[None] | None = None
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.comp.subscribe("kv-events")
        self._task = asyncio.create_task(self._pump())
        generate = await self.comp.endpoint("generate").client()
        self.workers = [i.instance_id for i in await generate.wait_for_instances(2, timeout=30)]
        await generate.close()
        # The index starts from each worker's dump, as a router joining late does.
        for wid in self.workers:
            for reply in await self.call("kv_dump", wid):
                for ev in reply.get("events", []):
                    self.index.apply_event(msgspec.convert(ev, RouterEvent))

    async def _pump(self) -> None:
        assert self._sub is not None
        async for msg in self._sub:
            self.index.apply_event(router_event_decoder.decode(msg.payload))
            self.events += 1

    async def call(self, endpoint: str, instance_id: int, body: dict | None = None) -> list[dict]:
        client = await self.comp.endpoint(endpoint).client()
        try:
            await client.wait_for_instances(1, timeout=10, routable=False)
            return await client.call(body or {}, instance_id=instance_id)
        finally:
            await client.close()

    def holders(self, tokens: list[int]) -> dict[int, int]:
        """worker id -> leading blocks of ``tokens`` it holds, per the index."""
        scores = self.index.find_matches(compute_block_hashes(tokens, BLOCK))
        return {worker[0]: n for worker, n in scores.scores.items()}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            await self._sub.close()


def prompt_tokens(seed: int, blocks: int) -> list[int]:
    """A prompt of ``blocks`` full blocks plus a partial one, distinct per seed."""
    return [(seed * 7919 + i * 31) % 4000 + 10 for i in range(blocks * BLOCK + 5)]


def test_streamed_chat_through_frontend(cluster: VllmCluster, api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list().data] == [MODEL]
    stream = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "In the beginning"}], max_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert len(content) >= 2 and content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens > 5
    # Random weights: any tokens, even ones whose bytes are not valid UTF-8 on their own.
    assert "".join(c.choices[0].delta.content or "" for c in content).strip()


def test_priorities_reach_vllms_priority_scheduler(cluster: VllmCluster, api: openai.OpenAI) -> None:
    """The adapter hands Dynamo's priority to ``AsyncLLM.generate(priority=)`` (sign flipped to
    vLLM's lower-first) when the engine runs ``--scheduling-policy priority``: vLLM takes every
    priority, both signs, and serves the requests."""
    # The adapter saw the policy (so it passes non-zero priorities on).
    assert all("priority_scheduling=True" in w.log_path.read_text(errors="replace") for w in cluster.workers)
    for priority in (7, -7, 0):
        resp = api.completions.create(
            model=MODEL, prompt="Priority", max_tokens=4,
            extra_body={"ignore_eos": True, "nvext": {"agent_hints": {"priority": priority}}},
        )
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4


def test_structured_output_and_top_logprobs_from_vllm(cluster: VllmCluster, api: openai.OpenAI) -> None:
    """Random weights, yet vLLM's structured outputs make the answer valid, and its logprobs
    arrive with their top alternatives (issue 16)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    resp = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer as JSON"}], max_tokens=24, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content)["ok"], bool)
    assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    picked = api.completions.create(model=MODEL, prompt="Colour:", max_tokens=8, extra_body={"guided_choice": ["red", "blue"]})
    assert picked.choices[0].text in ("red", "blue")


def test_forced_tool_call_and_n_choices_from_vllm(cluster: VllmCluster, api: openai.OpenAI) -> None:
    """A random-weight model never calls a tool by itself; ``tool_choice`` naming one makes vLLM's
    structured outputs produce a valid call (issue 16), and ``n`` gives that many choices."""
    # A short answer: random weights under a JSON grammar spend many tokens on whitespace.
    params = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    resp = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=64, n=2, seed=7,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for choice in resp.choices:
        calls = choice.message.tool_calls
        assert choice.finish_reason == "stop" and calls is not None and len(calls) == 1, choice
        assert calls[0].function.name == "get_weather"
        assert isinstance(json.loads(calls[0].function.arguments)["ok"], bool)


def test_repeated_long_prompt_reports_cached_tokens(cluster: VllmCluster, api: openai.OpenAI) -> None:
    prompt = "And God said, Let there be light: and there was light. " * 20
    first = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    n = second.usage.prompt_tokens
    assert first.usage.prompt_tokens == n > 4 * BLOCK
    # vLLM reuses every full block but always computes the last prompt token again.
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK


async def test_router_index_fills_from_native_events_and_routes_back(
    cluster: VllmCluster, api: openai.OpenAI, observer: Observer
) -> None:
    stored_before = _router_stored(cluster)
    prompts = [prompt_tokens(seed, 6) for seed in (11, 12, 13, 14)]
    first = [await asyncio.to_thread(api.completions.create, model=MODEL, prompt=p, max_tokens=2) for p in prompts]
    assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in first)
    owners = {}
    for p in prompts:
        holders = await _wait_holders(observer, p, 6)
        assert len(holders) == 1, f"blocks on more than one worker: {holders}"
        owners[tuple(p)] = next(iter(holders))
    # The frontend's router applied the same native events.
    await asyncio.to_thread(wait_until, lambda: _router_stored(cluster) > stored_before, 10, 0.05, "router stored events")
    for p in prompts:
        again = await asyncio.to_thread(api.completions.create, model=MODEL, prompt=p, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == 6 * BLOCK, "not routed back to the worker holding it"
        assert set(observer.holders(p)) == {owners[tuple(p)]}


async def test_cancel_aborts_the_vllm_request(cluster: VllmCluster, api: openai.OpenAI, observer: Observer) -> None:
    prompt = prompt_tokens(21, 2)
    stream = api.completions.create(model=MODEL, prompt=prompt, max_tokens=3500, stream=True,
                                    extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].text) > 0
        if got >= 3:
            break
    stream.close()
    closed = time.monotonic()
    holder = next(iter(await _wait_holders(observer, prompt, 2)))
    # vLLM resets its prefix cache only when no request holds KV blocks: the reset succeeding long
    # before 3500 tokens could have been generated shows the request was aborted in vLLM.
    while True:
        reply = (await observer.call("clear_kv_blocks", holder))[-1]
        if reply["status"] == "ok":
            break
        assert "in flight" in reply["message"]
        assert time.monotonic() - closed < 5.0, "the vLLM request kept running after the client went away"
        await asyncio.sleep(0.2)


async def test_lora_load_and_request(cluster: VllmCluster, api: openai.OpenAI, observer: Observer,
                                     paths: dict[str, Path]) -> None:
    for wid in observer.workers:
        reply = (await observer.call("load_lora", wid, {"lora_name": LORA, "source": str(paths["lora"])}))[-1]
        assert reply["status"] == "ok", reply
        listed = (await observer.call("list_loras", wid))[-1]
        assert [lo["name"] for lo in listed["loras"]] == [LORA]
    try:
        wait_until(lambda: LORA in {m.id for m in api.models.list().data}, 20, what="the LoRA model card")
        prompt = "And the earth was without form, and void"
        base = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        lora = api.completions.create(model=LORA, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert lora.model == LORA and lora.usage.completion_tokens == 8
        assert lora.choices[0].text != base.choices[0].text, "the adapter changed nothing"
    finally:
        for wid in observer.workers:
            (await observer.call("unload_lora", wid, {"lora_name": LORA}))[-1]
    wait_until(lambda: LORA not in {m.id for m in api.models.list().data}, 20, what="the LoRA card gone")


async def test_clear_kv_blocks_empties_the_workers_index_entries(
    cluster: VllmCluster, api: openai.OpenAI, observer: Observer
) -> None:
    prompt = prompt_tokens(31, 4)
    await asyncio.to_thread(api.completions.create, model=MODEL, prompt=prompt, max_tokens=2)
    holder = next(iter(await _wait_holders(observer, prompt, 4)))
    assert observer.index.tree_size((holder, 0)) >= 4
    reply = (await observer.call("clear_kv_blocks", holder))[-1]
    assert reply["status"] == "ok" and reply["cleared_blocks"] >= 4
    await _wait_async(lambda: observer.index.tree_size((holder, 0)) == 0, 10, "the worker's index entries cleared")
    again = await asyncio.to_thread(api.completions.create, model=MODEL, prompt=prompt, max_tokens=2,
                                    extra_headers={"x-dynamo-worker-instance-id": f"{holder:x}"})
    assert again.usage.prompt_tokens_details.cached_tokens == 0


async def _wait_holders(observer: Observer, tokens: list[int], blocks: int, timeout: float = 20.0) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        holders = {w: n for w, n in observer.holders(tokens).items() if n >= blocks}
        if holders:
            return holders
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker holds {blocks} blocks of the prompt; index={observer.holders(tokens)}")
        await asyncio.sleep(0.1)


async def _wait_async(cond, timeout: float, what: str) -> None:
    """Polls ``cond`` without blocking the loop (the observer's subscription runs on it)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def _router_stored(cluster: VllmCluster) -> float:
    text = get_text(cluster.url + "/metrics")
    m = re.search(r'dynamo_router_kv_events_total\{event_type="stored",outcome="applied"\} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0
