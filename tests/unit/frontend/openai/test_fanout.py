"""Fan-out (``n > 1``) in-process against scripted workers on the real request plane: choices
stream interleaved in pieces, one failing choice fails the whole request (error body or error
event, never a short answer), and a client that hangs up aborts every sibling's engine request."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from dynamod.daemon.frontend.openai.fanout import fans_out, sibling_seed
from dynamod.daemon.frontend.openai.schema import decode_chat_request, decode_completion_request
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.test_app import Cluster, client, token_at

FAILING_SEED = 8  # the worker fails the generation with this seed: sibling 1 of a seed=7 request


class SiblingWorker:
    """Streams ``max_tokens`` tokens one frame each; fails the generation whose seed is
    ``FAILING_SEED`` after two tokens; counts the generations aborted before their end."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.started = 0
        self.aborted = 0

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.started += 1
        prompt = body["token_ids"]
        max_tokens = body["stop"]["max_tokens"]
        seed = (body.get("sampling") or {}).get("seed")
        finished = False
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.delay_s)
                if seed == FAILING_SEED and i == 2:
                    finished = True
                    yield {"token_ids": [], "finish_reason": "error", "error": "sibling failed (test)"}
                    return
                out: dict[str, Any] = {"token_ids": [token_at(len(prompt) + i)]}
                if i == max_tokens - 1:
                    out["finish_reason"] = "length"
                    out["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens}
                    finished = True
                yield out
        finally:
            if not finished:
                self.aborted += 1


async def _cluster_with(worker: SiblingWorker) -> Cluster:
    c = Cluster()
    await c.start()
    assert c.rt is not None
    await c.serve(worker.handler, await c.rt.create_lease())
    return c


@pytest.fixture
async def worker() -> SiblingWorker:
    return SiblingWorker(delay_s=0.002)


@pytest.fixture
async def cluster(worker: SiblingWorker) -> AsyncIterator[Cluster]:
    c = await _cluster_with(worker)
    try:
        yield c
    finally:
        await c.stop()


MESSAGES = [{"role": "user", "content": "hi"}]


def test_fans_out_only_for_several_choices() -> None:
    assert not fans_out(decode_chat_request(b'{"model": "m", "messages": []}'))
    assert fans_out(decode_chat_request(b'{"model": "m", "messages": [], "n": 2}'))
    assert not fans_out(decode_completion_request(b'{"model": "m", "prompt": "a"}'))
    assert not fans_out(decode_completion_request(b'{"model": "m", "prompt": [1, 2, 3]}'))
    assert not fans_out(decode_completion_request(b'{"model": "m", "prompt": ["a"]}'))
    assert fans_out(decode_completion_request(b'{"model": "m", "prompt": ["a", "b"]}'))
    assert fans_out(decode_completion_request(b'{"model": "m", "prompt": [[1], [2]]}'))


def test_sibling_seeds_differ_and_stay_in_64_bits() -> None:
    assert sibling_seed(None, 3) is None
    assert [sibling_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert sibling_seed(2**63 - 1, 1) == -(2**63)


async def test_streamed_choices_interleave_in_pieces(cluster: Cluster) -> None:
    stream = await client(cluster).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, n=3, stream=True)
    order: list[int] = []
    text: dict[int, str] = defaultdict(str)
    async for chunk in stream:
        for choice in chunk.choices:
            order.append(choice.index)
            text[choice.index] += choice.delta.content or ""
    assert set(order) == {0, 1, 2}
    assert all(order.count(i) > 2 for i in range(3)), order  # each choice streams in several chunks
    switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert switches > 2, f"choices should interleave, got {order}"
    assert len(set(text.values())) == 1 and text[0]  # the scripted worker writes the same text to all


async def test_one_failing_choice_fails_the_unary_request(cluster: Cluster, worker: SiblingWorker) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        await client(cluster).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, n=3, seed=7)
    assert "sibling failed" in str(err.value)
    await cluster.wait(lambda: worker.aborted == 2)  # the healthy siblings were stopped, not left to run


async def test_one_failing_choice_ends_the_stream_with_an_error_event(cluster: Cluster, worker: SiblingWorker) -> None:
    stream = await client(cluster).completions.create(model="tiny", prompt="hi", max_tokens=20, n=3, seed=7, stream=True)
    finished: set[int] = set()
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.finish_reason is not None:
                    finished.add(choice.index)
    assert "sibling failed" in str(err.value)
    assert not finished  # no choice pretended to end normally
    await cluster.wait(lambda: worker.aborted == 2)


async def test_client_hang_up_aborts_every_sibling(cluster: Cluster, worker: SiblingWorker) -> None:
    worker.delay_s = 0.02
    body = {"model": "tiny", "prompt": ["a b", "c d"], "max_tokens": 200, "n": 2, "stream": True}
    async with httpx.AsyncClient(timeout=10) as http, http.stream("POST", cluster.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # the stream is running: hang up
    await cluster.wait(lambda: worker.aborted == 4)
    assert worker.started == 4
