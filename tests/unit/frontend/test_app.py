"""The frontend in-process against fake workers served on the real request plane (mem discovery).

The official ``openai`` client talks to the real HTTP server; fake workers are async generators
registered with ``endpoint.serve`` under their own leases and publishing their own model cards, so
discovery, routing, migration and cancellation all run through the production code.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from dynamod.daemon.frontend.app import build_app
from dynamod.daemon.frontend.http.server import HttpServer, bind_socket
from dynamod.daemon.frontend.pipeline.dispatch import Dispatcher
from dynamod.daemon.frontend.pipeline.metrics import FrontendMetrics
from dynamod.daemon.frontend.pipeline.models import ModelRegistry
from dynamod.daemon.frontend.pipeline.routing import (
    Quarantine,
    RoundRobinRouter,
    RouteChoice,
    RouteRequest,
    make_basic_router,
)
from dynamod.daemon.frontend.pipeline.state import FrontendConfig, FrontendState
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import UnavailableError
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.model_card import ModelCard, encode_card
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.distributed import DistributedRuntime, ServedInstance
from dynamod.shared.transport.plane import RequestContext

CONTEXT = 512
BASE_TOKEN = 300  # token ids 300..349 decode to plain ASCII pieces in the tiny vocabulary


def token_at(position: int) -> int:
    """What a fake worker generates at absolute position ``position``: migration-invariant."""
    return BASE_TOKEN + position % 50


@dataclass
class FakeWorker:
    lease: Any
    served: ServedInstance | None = None
    fail_after: int | None = None  # raise UnavailableError after this many tokens (once)
    delay_s: float = 0.0
    cached_tokens: int = 0
    requests: list[dict] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> int:
        return self.lease.id

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.requests.append(body)
        prompt = body["token_ids"]
        max_tokens = body["stop"]["max_tokens"]
        finished = False
        try:
            for i in range(max_tokens):
                if self.fail_after is not None and i == self.fail_after:
                    self.fail_after = None
                    raise UnavailableError("worker draining (test)")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                out: dict[str, Any] = {"token_ids": [token_at(len(prompt) + i)]}
                if i == max_tokens - 1:
                    out["finish_reason"] = "length"
                    out["usage"] = {"prompt_tokens": len(prompt), "cached_tokens": self.cached_tokens, "completion_tokens": max_tokens}
                    finished = True
                yield out
        finally:
            if not finished:
                self.aborted.set()


class Cluster:
    def __init__(self) -> None:
        self.store = MemStore()
        self.rt: DistributedRuntime | None = None
        self.workers: list[FakeWorker] = []
        self.server: HttpServer | None = None
        self.state: FrontendState | None = None
        self.url = ""

    async def start(self) -> None:
        settings = RuntimeSettings(discovery_backend="mem", event_plane="zmq", lease_ttl_s=5.0)
        self.rt = await DistributedRuntime.create(settings, store=self.store, events=False)
        metrics = FrontendMetrics(self.rt.registry)
        quarantine = Quarantine(hold_s=6.0)
        registry = ModelRegistry(self.rt, metrics, quarantine, lambda model: make_basic_router("round-robin"))
        dispatcher = Dispatcher(registry, quarantine, migration_limit=3, worker_wait_s=1.0)
        config = FrontendConfig(http_port=0, worker_wait_s=1.0, shutdown_grace_s=5.0)
        self.state = FrontendState(config=config, registry=registry, dispatcher=dispatcher, metrics=metrics)
        await registry.start()
        sock = bind_socket("127.0.0.1", 0)
        self.server = HttpServer(build_app(self.state), sock, graceful_s=2.0)
        await self.server.start()
        self.url = f"http://127.0.0.1:{self.server.port}"

    async def add_worker(self, model: str = "tiny", lora: str | None = None, **kw: Any) -> FakeWorker:
        assert self.rt is not None
        lease = await self.rt.create_lease()
        worker = FakeWorker(lease, **kw)
        self.workers.append(worker)
        worker.served = await self.serve(worker.handler, lease, model)
        return worker

    async def serve(self, handler: Any, lease: Any, model: str = "tiny") -> ServedInstance:
        """Serves ``handler`` as a worker of ``model`` under ``lease`` (publishing the model's card as a
        worker does) and waits until the frontend counts that worker ready."""
        assert self.rt is not None
        card = ModelCard(
            served_model_name=model, tokenizer_source=str(TINY_MODEL_DIR), context_length=CONTEXT, kv_block_size=16
        )
        await self.store.put(mdc_key("dynamo", "backend", "generate", lease.id), encode_card(card), lease)
        served = await self.rt.namespace().component("backend").endpoint("generate").serve(handler, lease=lease, model=model)
        await self.wait(lambda: any(w == worker_id_hex(lease.id) and s == "ready" for w, s in self.worker_states(model)))
        return served

    def worker_states(self, model: str) -> list[tuple[str, str]]:
        assert self.state is not None
        m = self.state.registry.models.get(model)
        if m is None:
            return []
        return [(worker_id_hex(wid), (pool.instances.get(wid).status if pool.instances.get(wid) else "none")) for wid, pool in m.workers.items()]

    async def wait(self, predicate: Any, timeout: float = 5.0) -> None:
        async def poll() -> None:
            while not predicate():  # noqa: ASYNC110 - a condition with a deadline, polled
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), timeout)

    async def stop(self) -> None:
        if self.server:
            await self.server.stop()
        if self.state:
            await self.state.registry.close()
        if self.rt:
            await self.rt.shutdown(grace_s=0.5)


def client(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=20)


def expected_text(prompt_len: int, n: int) -> str:
    from dynamod.daemon.frontend.preprocess import Tokenizer

    tok = Tokenizer.from_dir(TINY_MODEL_DIR)
    return tok.decode([token_at(prompt_len + i) for i in range(n)])


async def test_chat_and_completions_unary_and_streaming(cluster: Cluster) -> None:
    w = await cluster.add_worker(cached_tokens=4)
    api = client(cluster)
    models = await api.models.list()
    assert [m.id for m in models.data] == ["tiny"]

    chat = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=7)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens_details.cached_tokens == 4
    prompt_len = len(w.requests[-1]["token_ids"])
    assert chat.usage.prompt_tokens == prompt_len
    assert chat.choices[0].message.content == expected_text(prompt_len, 7)

    stream = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=9, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(prompt_len, 9)
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    comp = await api.completions.create(model="tiny", prompt="Once upon", max_tokens=5, echo=True)
    assert comp.choices[0].text.startswith("Once upon") and comp.usage.completion_tokens == 5
    streamed = await api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, stream=True)
    assert "".join([c.choices[0].text async for c in streamed]) == expected_text(3, 4)


async def test_errors_have_openai_shape_and_status(cluster: Cluster) -> None:
    await cluster.add_worker()
    api = client(cluster)
    with pytest.raises(openai.NotFoundError):
        await api.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=9)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        await api.completions.create(model="tiny", prompt="word " * 600, max_tokens=4)
    assert str(CONTEXT) in str(info.value)
    with pytest.raises(openai.BadRequestError):
        await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=0)

    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        bad_bodies = [b'{"model": "tiny", "messages": [', b"not json", b'{"model": 5}', b'{"model":"tiny","messages":"x"}',
                      b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"max_tokens":99999999999999999999999}',
                      b'{"model":"tiny","messages":[{"role":"wizard","content":"x"}]}', b"[]", b""]
        for body in bad_bodies:
            resp = await raw.post("/v1/chat/completions", content=body)
            assert resp.status_code == 400, (body, resp.text)
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert (await raw.get("/v1/nothing")).status_code == 404
        assert (await raw.get("/v1/chat/completions")).status_code == 405


async def test_stream_migrates_when_worker_stops_mid_stream(cluster: Cluster) -> None:
    a = await cluster.add_worker(fail_after=3)
    b = await cluster.add_worker()
    api = client(cluster)
    for _ in range(2):  # round-robin: one of the two requests starts on the failing worker
        stream = await api.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=10, stream=True)
        text = "".join([c.choices[0].text async for c in stream])
        assert text == expected_text(4, 10)  # nothing repeated, nothing missing
    resent = [r for r in a.requests + b.requests if len(r["token_ids"]) > 4]
    assert len(a.requests + b.requests) == 3 and len(resent) == 1
    resent = resent[0]
    assert resent["stop"]["max_tokens"] == 10 - 3
    assert resent["token_ids"] == [5, 6, 7, 8] + [token_at(4 + i) for i in range(3)]
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        metrics = (await raw.get("/metrics")).text
    assert 'dynamo_frontend_model_migration_total{migration_type="ongoing_request",model="tiny"} 1.0' in metrics


async def test_client_disconnect_aborts_engine_request(cluster: Cluster) -> None:
    w = await cluster.add_worker(delay_s=0.05)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True}
        async with raw.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break  # hang up after the first chunk
    await asyncio.wait_for(w.aborted.wait(), 5)
    await cluster.wait(lambda: cluster.state is not None and cluster.state.inflight == 0)


async def test_draining_worker_gets_no_new_requests_and_header_names_worker(cluster: Cluster) -> None:
    a = await cluster.add_worker()
    b = await cluster.add_worker()
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        served = {(await raw.post("/v1/completions", json=body)).headers["x-dynamo-worker-instance-id"] for _ in range(4)}
        assert served == {worker_id_hex(a.id), worker_id_hex(b.id)}
        assert b.served is not None
        await b.served.set_status("draining")
        await cluster.wait(lambda: (worker_id_hex(b.id), "draining") in cluster.worker_states("tiny"))
        served = {(await raw.post("/v1/completions", json=body)).headers["x-dynamo-worker-instance-id"] for _ in range(4)}
        assert served == {worker_id_hex(a.id)}
        # Direct routing by header reaches the named worker, in hex or decimal.
        direct = await raw.post("/v1/completions", json=body, headers={"x-dynamo-worker-instance-id": str(a.id)})
        assert direct.headers["x-dynamo-worker-instance-id"] == worker_id_hex(a.id)


async def test_models_follow_their_workers(cluster: Cluster) -> None:
    w = await cluster.add_worker(model="tiny")
    lora = await cluster.add_worker(model="tiny-lora")
    api = client(cluster)
    assert sorted(m.id for m in (await api.models.list()).data) == ["tiny", "tiny-lora"]
    await lora.lease.revoke()
    await cluster.wait(lambda: cluster.state is not None and "tiny-lora" not in cluster.state.registry.models)
    assert [m.id for m in (await api.models.list()).data] == ["tiny"]
    await w.lease.revoke()
    await cluster.wait(lambda: cluster.state is not None and not cluster.state.registry.models)
    assert (await api.models.list()).data == []


async def test_lora_card_routes_to_its_workers_with_adapter_name(cluster: Cluster) -> None:
    base = await cluster.add_worker()
    holder = await cluster.add_worker()
    assert cluster.rt is not None
    card = ModelCard(
        served_model_name="my-adapter", tokenizer_source=str(TINY_MODEL_DIR), context_length=CONTEXT,
        lora="my-adapter", base_model="tiny",
    )
    await cluster.store.put(mdc_key("dynamo", "backend", "generate", holder.id, "my-adapter"), encode_card(card), holder.lease)
    await cluster.wait(lambda: cluster.state is not None and "my-adapter" in cluster.state.registry.models)
    api = client(cluster)
    listed = {m.id: m for m in (await api.models.list()).data}
    assert set(listed) == {"tiny", "my-adapter"}
    for _ in range(3):
        await api.completions.create(model="my-adapter", prompt="hi", max_tokens=2)
    assert all(r.get("lora_name") == "my-adapter" for r in holder.requests)
    assert len(holder.requests) == 3 and not base.requests


async def test_graceful_shutdown_refuses_new_work_and_finishes_admitted(cluster: Cluster) -> None:
    await cluster.add_worker(delay_s=0.02)
    assert cluster.state is not None
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        async def long_stream() -> str:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 20, "stream": True}
            async with raw.stream("POST", "/v1/completions", json=body) as resp:
                return "".join([line async for line in resp.aiter_lines()])

        task = asyncio.create_task(long_stream())
        await cluster.wait(lambda: cluster.state is not None and cluster.state.inflight == 1)
        cluster.state.draining = True
        assert (await raw.get("/health")).status_code == 503
        refused = await raw.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        text = await task
        assert text.count('"finish_reason":"length"') == 1 and text.endswith("[DONE]")


async def test_health_reports_pid_and_workers(cluster: Cluster) -> None:
    w = await cluster.add_worker()
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        body = (await raw.get("/health")).json()
        assert (await raw.get("/live")).status_code == 200
    assert body["status"] == "healthy" and isinstance(body["pid"], int)
    assert body["models"][0]["workers"] == [{"instance_id": worker_id_hex(w.id), "status": "ready"}]
    assert json.dumps(body)


async def test_request_waits_for_a_worker_that_becomes_ready(cluster: Cluster) -> None:
    w = await cluster.add_worker()
    assert w.served is not None and cluster.state is not None
    await w.served.set_status("sleeping")
    await cluster.wait(lambda: (worker_id_hex(w.id), "sleeping") in cluster.worker_states("tiny"))
    api = client(cluster)
    task = asyncio.create_task(api.completions.create(model="tiny", prompt="hi", max_tokens=3))
    # Admitted and held while no worker is ready (worker_wait), not refused.
    await cluster.wait(lambda: cluster.state is not None and cluster.state.inflight == 1)
    assert not task.done()
    await w.served.set_status("ready")
    reply = await asyncio.wait_for(task, 5)
    assert reply.usage.completion_tokens == 3
    # Nobody wakes up: after worker_wait the request gets a 503 with a retry hint.
    await w.served.set_status("sleeping")
    await cluster.wait(lambda: (worker_id_hex(w.id), "sleeping") in cluster.worker_states("tiny"))
    with pytest.raises(openai.APIStatusError) as info:
        await api.completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert info.value.status_code == 503


async def test_overload_gets_503_with_retry_after(cluster: Cluster) -> None:
    await cluster.add_worker(delay_s=0.05)
    assert cluster.state is not None
    cluster.state.config.max_inflight = 1
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 10, "stream": True}
        async with raw.stream("POST", "/v1/completions", json=body) as first:
            refused = await raw.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
            text = "".join([line async for line in first.aiter_lines()])
    assert text.endswith("[DONE]")


async def test_stop_string_ends_stream_and_aborts_engine(cluster: Cluster) -> None:
    w = await cluster.add_worker(delay_s=0.01)
    full = expected_text(3, 40)
    stop = full[20:26]
    api = client(cluster)
    reply = await api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=40, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == full[: full.index(stop)]
    await asyncio.wait_for(w.aborted.wait(), 5)  # the engine did not generate the remaining tokens


async def test_logprobs_and_token_ids_pass_through(cluster: Cluster) -> None:
    w = await cluster.add_worker()
    original = w.handler

    async def with_logprobs(body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        async for out in original(body, ctx):
            out["log_probs"] = [-0.5] * len(out["token_ids"])
            yield out

    w.handler = with_logprobs  # type: ignore[method-assign]
    assert w.served is not None
    w.served.stop_serving()
    w.served = await cluster.rt.namespace().component("backend").endpoint("generate").serve(  # type: ignore[union-attr]
        with_logprobs, lease=w.lease, model="tiny"
    )
    api = client(cluster)
    chat = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5, logprobs=True,
        extra_body={"return_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(c.logprob == -0.5 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert len(chat.choices[0].model_extra["token_ids"]) == 5


async def test_token_coalescing_merges_chunks(cluster: Cluster) -> None:
    await cluster.add_worker(delay_s=0.002)
    assert cluster.state is not None
    cluster.state.config.coalesce_s = 10.0  # everything after the first token waits for the end
    api = client(cluster)
    stream = await api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=12, stream=True)
    chunks = [c async for c in stream]
    assert len(chunks) == 2
    assert "".join(c.choices[0].text for c in chunks) == expected_text(3, 12)


async def test_metrics_use_dynamo_names(cluster: Cluster) -> None:
    await cluster.add_worker(cached_tokens=2)
    api = client(cluster)
    stream = await api.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=4, stream=True)
    assert len([c async for c in stream]) >= 1
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        text = (await raw.get("/metrics")).text
    assert 'dynamo_frontend_requests_total{endpoint="completions",model="tiny",request_type="stream",status="success"} 1.0' in text
    for name in (
        "dynamo_frontend_inflight_requests",
        "dynamo_frontend_time_to_first_token_seconds_bucket",
        "dynamo_frontend_inter_token_latency_seconds_bucket",
        "dynamo_frontend_input_sequence_tokens_bucket",
        "dynamo_frontend_output_sequence_tokens_bucket",
        "dynamo_frontend_request_duration_seconds_bucket",
        "dynamo_frontend_model_migration_total",
    ):
        assert f"{name}{{" in text or f"{name} " in text, name
    assert 'dynamo_frontend_kv_hit_rate{model="tiny"} 0.5' in text  # 2 cached of 4 prompt tokens


class HoldFirstRouter(RoundRobinRouter):
    """Holds its first pick (as the KV router's queue holds a request while every worker is busy),
    then returns ``victim`` even though it may have left meanwhile."""

    def __init__(self, victim: int) -> None:
        super().__init__()
        self.victim = victim
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.finished: list[str] = []

    async def select(self, request: RouteRequest, candidates: Sequence[Instance]) -> RouteChoice:
        if not self.held.is_set():
            self.held.set()
            await self.release.wait()
            return RouteChoice(next(c for c in candidates if c.instance_id == self.victim), stage=request.stage)
        return await super().select(request, candidates)

    def on_finish(self, request_id: str) -> None:
        self.finished.append(request_id)


async def test_a_worker_that_leaves_while_the_router_holds_the_request_is_routed_around(cluster: Cluster) -> None:
    """Found by the planner's scale-down test: the router picked a worker that was removed while
    the request waited in it, and the lookup of that worker's pool raised KeyError (a 500)."""
    a = await cluster.add_worker()
    b = await cluster.add_worker()
    assert cluster.state is not None
    model = cluster.state.registry.models["tiny"]
    router = HoldFirstRouter(a.id)
    model.router = router
    api = client(cluster)
    request = asyncio.ensure_future(api.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6))
    await asyncio.wait_for(router.held.wait(), 5)
    await a.lease.revoke()  # the worker's records go: as when the planner retires it
    await cluster.wait(lambda: a.id not in model.workers)
    router.release.set()
    result = await asyncio.wait_for(request, 10)
    assert result.choices[0].text == expected_text(4, 6)
    assert a.requests == [] and len(b.requests) == 1
    assert len(router.finished) == 2  # the abandoned pick released, then the served request
