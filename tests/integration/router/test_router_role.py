"""``dynamod --role router`` as a real process in front of two mocker workers.

The standalone router must stream whole outputs from the worker it picked, keep sending a repeated
long prompt to the worker that cached it (learned from the workers' KV events), answer
``best_worker_id`` without counting load, send a LoRA request only to workers holding the adapter,
free a request its caller cancelled (and cancel it on the worker), publish its decisions on
``router_decisions``, and on SIGTERM leave discovery at once while finishing the streams it is
serving. The helpers at the top are shared with the other router test modules.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import urllib.error
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.errors import NotFoundError
from dynamod.shared.events.plane import TOPIC_ROUTER_DECISIONS
from dynamod.shared.protocol.llm import PreprocessedRequest, StopConditions
from dynamod.shared.runtime.client import EndpointClient
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import free_port, poll, wait_until
from tests.integration.frontend.test_frontend_support import CLI, LocalCluster, Proc, get_json, get_text

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
WORKER_FLAGS = ("--block-size", str(BLOCK), "--num-gpu-blocks", "512")


# ------------------------------------------------------------------------------------------------
# Helpers shared by test_router_role, test_router_sync and test_router_recovery.


class RoleProc:
    """A ``dynamod --role <role>`` process of ``cluster`` serving HTTP on a port of its own (given by
    ``port_flag``), where its ``/health`` and ``/metrics`` are read."""

    role = ""
    port_flag = ""

    def __init__(self, cluster: LocalCluster, name: str, *extra: str) -> None:
        self.port = free_port()
        argv = [*CLI, "--role", self.role, *cluster.runtime_flags(), self.port_flag, str(self.port),
                "--worker-wait", "3", *extra]
        self.proc = Proc(name, argv, cluster.env, cluster.root)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        return metric_value(get_text(self.url + "/metrics"), name)


class RouterProc(RoleProc):
    """A ``dynamod --role router`` process with its status server on a known port."""

    role = "router"
    port_flag = "--system-port"

    def health(self) -> dict | None:
        try:
            return get_json(self.url + "/health")
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_ready(self, workers: int, timeout: float = 60.0) -> dict:
        def check() -> dict | None:
            if not self.proc.alive():
                raise AssertionError(f"{self.proc.name} exited:\n{self.proc.log()}")
            body = self.health()
            if body and body.get("status") == "ready" and body.get("workers", 0) >= workers:
                return body
            return None

        return wait_until(check, timeout, interval=0.1, what=f"{self.proc.name} ready with {workers} workers")


def metric_value(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in a Prometheus text page; 0 when absent."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.MULTILINE):
        total += float(m.group(1))
    return total


def start_workers(cluster: LocalCluster, count: int, *extra: str) -> list[Proc]:
    return [cluster.start_worker(*WORKER_FLAGS, *extra) for _ in range(count)]


def prompt(i: int, blocks: int) -> list[int]:
    """A prompt of ``blocks`` full blocks whose first block is unique to ``i``."""
    return [(i * 131 + j * 7 + 1) % 4000 for j in range(blocks * BLOCK)]


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> dict:
    req = PreprocessedRequest(request_id=rid, model="tiny", token_ids=tokens,
                              stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))
    return msgspec.to_builtins(req)


def runtime_settings(cluster: LocalCluster) -> RuntimeSettings:
    return RuntimeSettings(discovery_backend="file", file_kv=str(cluster.file_kv), event_plane="zmq",
                           lease_ttl_s=cluster.lease_ttl)


async def endpoint_client(rt: DistributedRuntime, component: str, endpoint: str, count: int = 1) -> EndpointClient:
    client = await rt.namespace().component(component).endpoint(endpoint).client()
    await client.wait_for_instances(count, timeout=30.0)
    return client


async def run_stream(client: EndpointClient, body: dict, instance_id: int | None = None) -> list[dict]:
    return [out async for out in client.generate(body, instance_id=instance_id, timeout_s=30.0)]


async def best(client: EndpointClient, tokens: list[int], instance_id: int | None = None, **extra: Any) -> dict:
    [answer] = await client.call({"token_ids": tokens, **extra}, instance_id=instance_id, timeout_s=10.0)
    return answer


async def wait_kv_events_flowing(
    generate: EndpointClient, best_client: EndpointClient, instance_id: int | None = None, tag: int = 900
) -> None:
    """Sends short prompts through a router until one shows up as cached in its index.

    The router subscribes to the workers' events when it sees them; ZMQ connects asynchronously
    (slow joiner), so a prompt routed in that window may never be indexed. After this, events flow.
    """
    for attempt in range(40):
        tokens = prompt(tag + attempt, 1)
        await run_stream(generate, request(f"warm-{tag}-{attempt}", tokens, 1), instance_id)
        try:
            await poll(lambda t=tokens: answer_with_overlap(best_client, t, instance_id), 0.5, "warm-up prompt indexed")
            return
        except AssertionError:
            continue
    raise AssertionError("the router never indexed a routed prompt: KV events are not reaching it")


async def answer_with_overlap(client: EndpointClient, tokens: list[int], instance_id: int | None = None) -> dict | None:
    """The ``best_worker_id`` answer for ``tokens`` once some worker is known to cache them."""
    answer = await best(client, tokens, instance_id)
    return answer if answer["overlap_blocks"] > 0 else None


# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, RouterProc]]:
    c = LocalCluster(tmp_path_factory.mktemp("router-role"), speedup=20.0)
    c.env["DYN_LORA_REMOTE_SCHEMES"] = "mock"  # the mocker's adapters need no files (lora_policy)
    router: RouterProc | None = None
    try:
        start_workers(c, 2)
        router = RouterProc(c, "router")
        router.wait_ready(2)
        yield c, router
    finally:
        if router is not None:
            router.proc.stop()
        c.stop()


@pytest.fixture
async def clients(cluster: tuple[LocalCluster, RouterProc]) -> AsyncIterator[tuple[EndpointClient, EndpointClient, DistributedRuntime]]:
    c, _router = cluster
    rt = await DistributedRuntime.create(runtime_settings(c))
    try:
        generate = await endpoint_client(rt, "router", "generate")
        best_client = await endpoint_client(rt, "router", "best_worker_id")
        await wait_kv_events_flowing(generate, best_client)
        yield generate, best_client, rt
    finally:
        await rt.shutdown(1)


async def test_generate_streams_whole_output_and_follows_the_cache(clients) -> None:
    generate, best_client, _rt = clients
    served: dict[int, list[int]] = {}
    for p in range(2):
        tokens = prompt(p, 8)
        for n in range(3):
            outs = await run_stream(generate, request(f"p{p}-{n}", tokens, max_tokens=6))
            assert outs[0]["worker_id"] > 0 and "dp_rank" in outs[0]
            assert sum(len(o.get("token_ids") or []) for o in outs) == 6
            assert outs[-1]["finish_reason"] == "length"
            cached = outs[-1]["usage"].get("cached_tokens", 0)
            assert (cached == 0) if n == 0 else (cached >= 7 * BLOCK), (p, n, cached)
            served.setdefault(p, []).append(outs[0]["worker_id"])
    for p, workers in served.items():
        assert len(set(workers)) == 1, (p, workers)


async def test_best_worker_id_answers_the_cache_holder_without_counting_load(clients) -> None:
    generate, best_client, _rt = clients
    tokens = prompt(7, 6)
    outs = await run_stream(generate, request("cache-me", tokens))
    holder = outs[0]["worker_id"]
    answer = await poll(lambda: answer_with_overlap(best_client, tokens), 5.0, "prompt indexed")
    assert answer["worker_id"] == holder
    assert answer["overlap_blocks"] == 6
    ex = answer["explain"]
    assert ex["worker_id"] == holder and ex["request_blocks"] == 6
    assert len(ex["candidates"]) == 2
    for c in ex["candidates"]:
        assert {"overlap_blocks", "prefill_tokens", "prefill_blocks", "decode_blocks", "cost", "tree_size"} <= set(c)
    # Asking again and again registers nothing: every candidate's load terms stay the same.
    again = [await best(best_client, tokens) for _ in range(5)]
    assert [a["explain"]["candidates"] for a in again] == [ex["candidates"]] * 5
    assert all(a["worker_id"] == holder for a in again)
    # The same prompt sent for real lands there too.
    outs = await run_stream(generate, request("cache-me-again", tokens))
    assert outs[0]["worker_id"] == holder


async def test_lora_requests_go_only_to_workers_holding_the_adapter(clients) -> None:
    generate, best_client, rt = clients
    control = await endpoint_client(rt, "backend", "load_lora", count=2)
    holder = control.instances[0].instance_id
    await control.call({"lora_name": "ad1", "source": "mock://ad1"}, instance_id=holder)
    try:
        async def known() -> dict | None:
            try:
                return await best(best_client, prompt(30, 2), lora_name="ad1")
            except NotFoundError:
                return None

        assert (await poll(known, 10.0, "router to see the adapter's card"))["worker_id"] == holder
        for i in range(4):
            body = request(f"lora-{i}", prompt(31 + i, 2), 2)
            body["lora_name"] = "ad1"
            outs = await run_stream(generate, body)
            assert outs[0]["worker_id"] == holder
            assert outs[-1]["finish_reason"] == "length"
        with pytest.raises(NotFoundError, match="ad2"):
            await best(best_client, prompt(36, 2), lora_name="ad2")
    finally:
        unload = await endpoint_client(rt, "backend", "unload_lora", count=2)
        await unload.call({"lora_name": "ad1"}, instance_id=holder)


async def test_cancelled_stream_frees_the_request_and_the_worker(cluster, clients) -> None:
    c, router = cluster
    generate, best_client, _rt = clients
    stream = generate.generate(request("long", prompt(11, 4), max_tokens=4000), timeout_s=60.0)
    first = await anext(stream)
    worker = first["worker_id"]
    probe = prompt(12, 2)
    loaded = await best(best_client, probe)
    on_worker = next(x for x in loaded["explain"]["candidates"] if x["worker_id"] == worker)
    assert on_worker["decode_blocks"] > loaded["explain"]["request_blocks"], "the running request is not counted"
    assert await asyncio.to_thread(router.metric, "dynamo_router_active_requests") == 1
    await stream.aclose()
    await poll(lambda: _router_idle(router), 10.0, "router to free the cancelled request")
    # The worker stopped generating too: nothing is in flight on any worker.
    for name, port in c.worker_status_ports.items():
        await poll(lambda p=port: _worker_idle(p), 10.0, f"{name} to abort the cancelled request")
    answer = await best(best_client, probe)
    assert all(x["decode_blocks"] == answer["explain"]["request_blocks"] for x in answer["explain"]["candidates"])


async def _worker_idle(port: int) -> bool:
    health = await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/health")
    return health["inflight"] == 0


async def _router_idle(router: RouterProc) -> bool:
    return await asyncio.to_thread(router.metric, "dynamo_router_active_requests") == 0


async def test_decisions_are_published_for_the_console(clients) -> None:
    generate, _best, rt = clients
    sub = await rt.events.subscribe(rt.settings.namespace, "*", TOPIC_ROUTER_DECISIONS)
    it = sub.__aiter__()
    try:
        for attempt in range(40):  # the subscription connects asynchronously: retry until one arrives
            await run_stream(generate, request(f"decided-{attempt}", prompt(20 + attempt, 2), 1))
            try:
                async with asyncio.timeout(0.5):
                    while True:
                        msg = await anext(it)
                        data = msgspec.msgpack.decode(msg.payload)
                        if data.get("request_id") == f"decided-{attempt}":
                            break
                break
            except TimeoutError:
                continue
        else:
            raise AssertionError("no routing decision arrived on router_decisions")
    finally:
        await sub.close()
    assert data["source"] == "router"
    assert data["worker_id"] in {x["worker_id"] for x in data["candidates"]}
    assert data["request_blocks"] == 2 and data["isl"] == 2 * BLOCK
    assert len(data["candidates"]) == 2 and all("cost" in x for x in data["candidates"])
    assert data["ts"] > 0 and data["reason"]


async def test_sigterm_drains_finishes_streams_then_leaves_discovery(cluster, clients) -> None:
    """Last in the module: it stops the router. On SIGTERM it is marked draining (no new work),
    its open stream runs to the end on it (no fail-over), and only then does its record go."""
    _c, router = cluster
    generate, _best, _rt = clients
    stream = generate.generate(request("drained", prompt(40, 2), max_tokens=1000), timeout_s=60.0)
    outs = [await anext(stream)]
    router.proc.popen.send_signal(signal.SIGTERM)
    await poll(lambda: _router_draining(generate), 10.0, "router to be marked draining")
    outs += [out async for out in stream]
    assert sum(len(o.get("token_ids") or []) for o in outs) == 1000
    assert outs[-1]["finish_reason"] == "length"
    assert await asyncio.to_thread(router.proc.popen.wait, 15) == 0
    await poll(lambda: _no_router(generate), 10.0, "router to leave discovery")


async def _router_draining(client: EndpointClient) -> bool:
    return bool(client.instances) and all(i.status == "draining" for i in client.instances)


async def _no_router(client: EndpointClient) -> bool:
    return not client.instances
