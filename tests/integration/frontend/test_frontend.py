"""The frontend as a real process in front of real mocker workers, driven by the official client.

One cluster (2 workers + frontend) is shared by the module: each test leaves it as it found it.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import (
    CLI,
    LocalCluster,
    Proc,
    cluster_fixture,
    get_json,
    get_text,
    openai_fixture,
    pid_gone,
    worker_control,
)

pytestmark = pytest.mark.timeout(180)


cluster = cluster_fixture("frontend-cluster")
api = openai_fixture(30)


def test_models_chat_and_completions(cluster: LocalCluster, api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list().data] == ["tiny"]
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    assert chat.usage.prompt_tokens > 5 and chat.id.startswith("chatcmpl-") and chat.model == "tiny"

    stream = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream please"}], max_tokens=40, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    # The streamed text, delta by delta, is exactly the decoding of all generated tokens: no
    # character split between chunks, none lost or doubled.
    token_ids = [t for c in content_chunks for t in c.choices[0].model_extra["token_ids"]]
    assert len(token_ids) == 40
    streamed = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert streamed == Tokenizer.from_dir(TINY_MODEL_DIR).decode(token_ids)

    comp = api.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, extra_body={"ignore_eos": True})
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 6
    text = "".join(c.choices[0].text for c in api.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
    assert isinstance(text, str)


def test_cached_tokens_reported_on_repeat_prompt(cluster: LocalCluster, api: openai.OpenAI) -> None:
    worker = cluster.ready_workers()[0]
    prompt = "a fairly long shared prefix for caching " * 20
    headers = {"x-dynamo-worker-instance-id": worker}
    first = api.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers=headers)
    second = api.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers=headers)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens


def test_errors(cluster: LocalCluster, api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=-5)
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="tiny", prompt="word " * 9000, max_tokens=4)
    assert re.search(r"maximum context length is \d+ tokens", str(info.value))


def test_bad_input_never_gives_500(cluster: LocalCluster) -> None:
    bodies = [
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}', b"{}", b"null", b"12", b"\x00\xff",
        b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e309}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 123456789012345678901234567890}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": {"a": 1}}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        b'{"model": "tiny", "prompt": [99999999]}', b'{"model": "tiny", "prompt": [[1], "x"]}',
        b'{"model": ["tiny"], "prompt": "x"}', b'{"model": "tiny", "prompt": "x", "logprobs": 100}',
    ]
    with httpx.Client(base_url=cluster.url, timeout=30) as raw:
        for body in bodies:
            for path in ("/v1/chat/completions", "/v1/completions"):
                resp = raw.post(path, content=body, headers={"content-type": "application/json"})
                assert 400 <= resp.status_code < 500, (path, body, resp.status_code, resp.text)
                assert "Traceback" not in resp.text and resp.json()["error"]["message"]


def _generate_durations(cluster: LocalCluster) -> tuple[float, float]:
    """(count, sum) of the workers' generate request durations."""
    count = total = 0.0
    for port in cluster.worker_status_ports.values():
        try:
            text = get_text(f"http://127.0.0.1:{port}/metrics")
        except OSError:
            continue
        for line in text.splitlines():
            if 'dynamo_endpoint="generate"' not in line:
                continue
            if line.startswith("dynamo_component_request_duration_seconds_count{"):
                count += float(line.rsplit(" ", 1)[1])
            elif line.startswith("dynamo_component_request_duration_seconds_sum{"):
                total += float(line.rsplit(" ", 1)[1])
    return count, total


def test_openai_edge_cases_from_review(cluster: LocalCluster, api: openai.OpenAI) -> None:
    """Explicit nulls OpenAI allows, model retrieval, deep nesting and a malformed direct-routing
    header: each gets the OpenAI answer, never a 500 or a retryable 503."""
    url = cluster.url + "/v1"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with httpx.Client(timeout=30) as http:
        nulls = {**chat, "n": None, "stream": None, "logprobs": None, "ignore_eos": None, "add_generation_prompt": None}
        resp = http.post(url + "/chat/completions", json=nulls)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
        comp = http.post(url + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "echo": None, "n": None})
        assert comp.status_code == 200, comp.text
        deep = b'{"model":"tiny","messages":[],"foo":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        resp = http.post(url + "/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        resp = http.post(url + "/chat/completions", json=chat, headers={"x-dynamo-worker-instance-id": "zzz"})
        assert resp.status_code == 400 and "neither hex nor decimal" in resp.json()["error"]["message"]
        missing = http.get(url + "/models/no-such-model")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert api.models.retrieve("tiny").id == "tiny"


def test_client_disconnect_aborts_engine_request(cluster: LocalCluster) -> None:
    # 4000 tokens take the mocker seconds; a hang-up after the first chunk must end the engine
    # request right away, which shows as a short generate duration on the worker.
    count0, sum0 = _generate_durations(cluster)
    body = {"model": "tiny", "prompt": "keep going", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    started = time.monotonic()
    with httpx.Client(base_url=cluster.url, timeout=30) as raw:
        with raw.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            resp.close()
    count1, sum1 = wait_until(
        lambda: (c := _generate_durations(cluster))[0] > count0 and c, 10, what="the engine request to end"
    )
    assert time.monotonic() - started < 2.0
    assert sum1 - sum0 < 1.0, "the worker kept generating after the client left"
    wait_until(lambda: cluster.health()["inflight"] == 0, 10, what="the frontend to release the request")
    metrics = get_text(cluster.url + "/metrics")
    assert re.search(r'dynamo_frontend_client_disconnects_total\{model="tiny"\} [1-9]', metrics)



def test_draining_worker_gets_no_new_requests(cluster: LocalCluster, api: openai.OpenAI) -> None:
    a, b = cluster.ready_workers()[:2]
    asyncio.run(worker_control(cluster, "drain", b, {"wait": False}))
    try:
        wait_until(lambda: cluster.ready_workers() == [a], 10, what="the drained worker to leave the ready set")
        served = set()
        for _ in range(6):
            raw = api.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
            served.add(raw.headers["x-dynamo-worker-instance-id"])
        assert served == {a}
    finally:
        asyncio.run(worker_control(cluster, "wake_up", b, {}))
        wait_until(lambda: len(cluster.ready_workers()) == 2, 10, what="the worker to be ready again")


def test_models_appear_and_disappear_with_their_workers(cluster: LocalCluster, api: openai.OpenAI) -> None:
    other = cluster.start_worker("--served-model-name", "tiny-other")
    try:
        cluster.wait_ready(1, model="tiny-other")
        assert sorted(m.id for m in api.models.list().data) == ["tiny", "tiny-other"]
        reply = api.completions.create(model="tiny-other", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert reply.model == "tiny-other" and reply.usage.completion_tokens == 3
    finally:
        other.stop()
        cluster.workers.remove(other)
    wait_until(lambda: [m.id for m in api.models.list().data] == ["tiny"], 15, what="tiny-other to disappear")


def test_num_frontends_share_one_port(cluster: LocalCluster) -> None:
    port = free_port()
    argv = [*CLI, "--role", "frontend", *cluster.runtime_flags(), "--http-port", str(port), "--num-frontends", "2"]
    fleet = Proc("frontend-fleet", argv, cluster.env, cluster.root)
    url = f"http://127.0.0.1:{port}"
    try:
        def group_pids() -> list[int] | None:
            pids = get_json(url + "/health")["frontend_pids"]
            return pids if len(pids) == 2 else None

        group = wait_until(group_pids, 30, what="both frontends to start")
        seen: set[int] = set()

        def both_answer() -> bool:
            with httpx.Client(base_url=url, timeout=10) as fresh:  # a new connection each time
                seen.add(fresh.get("/health").json()["pid"])
            return seen == set(group)

        wait_until(both_answer, 30, what="connections to reach both processes")
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        reply = api.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
    finally:
        assert fleet.stop() == 0
    for pid in group:
        wait_until(lambda pid=pid: pid_gone(pid), 15, what=f"frontend {pid} to exit")
