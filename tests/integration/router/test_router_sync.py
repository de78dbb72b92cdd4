"""Replica sync (``--router-replica-sync``): routers in front of the same workers count each other's
requests, so a burst sent alternately to two of them spreads across the workers.

Each request of the burst stays running (its caller holds the stream open) while the next one is
routed, and before the next one goes to the *other* replica the test waits until that replica
counts it (``dynamo_router_active_requests``: its own requests plus its replicas'); that is the
propagation a real burst gets for free between requests a few milliseconds apart. With sync each
request then lands on the worker with fewer running requests; without it, every replica sees only
its own requests and, for each pair, both pick the same idle-looking worker: one worker caches a
long unrelated prompt before the replicas start, so among idle workers every replica prefers the
other one (smallest cached tree), which makes the unsynced outcome certain rather than random.

Covered for two standalone routers (answers carry ``worker_id``) and for two frontends
(``x-dynamo-worker-instance-id``), where the ``x-dynamo-route-explain`` header shows the
per-candidate terms, the other frontend's request included, and decisions reach the console's
``router_decisions`` topic.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack

import httpx
import msgspec
import pytest

from dynamod.shared.events.plane import TOPIC_ROUTER_DECISIONS
from dynamod.shared.runtime.client import EndpointClient
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster, get_json
from tests.integration.router.test_router_role import (
    RoleProc,
    RouterProc,
    answer_with_overlap,
    endpoint_client,
    poll,
    prompt,
    request,
    run_stream,
    runtime_settings,
    start_workers,
)

pytestmark = pytest.mark.timeout(180)

ACTIVE = "dynamo_router_active_requests"
PRIME_BLOCKS = 64
HELD_TOKENS = 3000  # long enough to outlive the test; the held streams are cancelled at the end
BURST = 8


class FrontendProc(RoleProc):
    role = "frontend"
    port_flag = "--http-port"

    def ready_workers(self) -> int:
        try:
            body = get_json(self.url + "/health")
        except OSError:
            return 0
        return sum(len([w for w in m["workers"] if w["status"] == "ready"]) for m in body.get("models", []))

    def wait_ready(self, workers: int, timeout: float = 60.0) -> None:
        def check() -> bool:
            if not self.proc.alive():
                raise AssertionError(f"{self.proc.name} exited:\n{self.proc.log()}")
            return self.ready_workers() >= workers

        wait_until(check, timeout, interval=0.1, what=f"{self.proc.name} with {workers} ready workers")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, list[RouterProc], list[FrontendProc]]]:
    # Real-time decode (speedup 1): an HTTP stream nobody reads is buffered by the sockets, so
    # the frontends' held requests must stay busy generating for the test's few seconds.
    c = LocalCluster(tmp_path_factory.mktemp("router-sync"), speedup=1.0)
    routers: list[RouterProc] = []
    frontends: list[FrontendProc] = []
    try:
        start_workers(c, 2, "--num-gpu-blocks", "4096")
        primed = asyncio.run(_prime_one_worker(c))
        routers = [RouterProc(c, f"router-{i}", "--router-replica-sync") for i in range(2)]
        frontends = [FrontendProc(c, f"frontend-{i}", "--router-mode", "kv", "--router-replica-sync") for i in range(2)]
        for r in routers:
            r.wait_ready(2)
        for f in frontends:
            f.wait_ready(2)
        yield c, routers, frontends, primed
    finally:
        for proc in [*routers, *frontends]:
            proc.proc.stop()
        c.stop()


async def _prime_one_worker(c: LocalCluster) -> int:
    """Caches a long prompt on one worker (sent to it directly); returns that worker's id."""
    rt = await DistributedRuntime.create(runtime_settings(c))
    try:
        workers = await endpoint_client(rt, "backend", "generate", count=2)
        wid = workers.instances[0].instance_id
        outs = await run_stream(workers, request("prime", PRIME, 1), instance_id=wid)
        assert outs[-1]["finish_reason"] == "length"
        return wid
    finally:
        await rt.shutdown(1)


PRIME = prompt(400, PRIME_BLOCKS)


@pytest.fixture
async def rt(cluster) -> AsyncIterator[DistributedRuntime]:
    runtime = await DistributedRuntime.create(runtime_settings(cluster[0]))
    try:
        yield runtime
    finally:
        await runtime.shutdown(1)


async def active(replica: RouterProc | FrontendProc) -> float:
    return await asyncio.to_thread(replica.metric, ACTIVE)


async def wait_active(replica: RouterProc | FrontendProc, count: int, timeout: float = 10.0) -> None:
    async def check() -> bool:
        return await active(replica) == count

    await poll(check, timeout, f"{replica.proc.name} to count {count} active requests")


# ------------------------------------------------------------------------------------------------
# Two standalone routers.


async def _until_replica_counts(
    hold: Callable[[int], Awaitable[Callable[[], Awaitable[None]]]],
    src: RouterProc | FrontendProc,
    dst: RouterProc | FrontendProc,
) -> None:
    """Holds one request on ``src`` at a time (``hold(attempt)`` opens it and returns its close)
    until ``dst`` counts it: the replicas' ZMQ subscribers connect asynchronously."""
    for attempt in range(40):
        close = await hold(attempt)
        try:
            await wait_active(dst, 1, timeout=0.5)
            seen = True
        except AssertionError:
            seen = False
        await close()
        await wait_active(src, 0)
        await wait_active(dst, 0)
        if seen:
            return
    raise AssertionError(f"{dst.proc.name} never saw its replica's requests")


async def _sync_connected_routers(generate: EndpointClient, src: int, dst: RouterProc, srcp: RouterProc) -> None:
    """Holds a request on ``src`` until ``dst`` counts it (ZMQ subscribers connect asynchronously)."""

    async def hold(attempt: int) -> Callable[[], Awaitable[None]]:
        stream = generate.generate(request(f"sync-warm-{src:x}-{attempt}", prompt(500 + attempt, 1), HELD_TOKENS),
                                   instance_id=src, timeout_s=60.0)
        await anext(stream)
        return stream.aclose

    await _until_replica_counts(hold, srcp, dst)


async def test_two_routers_spread_a_burst(cluster, rt: DistributedRuntime) -> None:
    _c, routers, _f, primed = cluster
    generate = await endpoint_client(rt, "router", "generate", count=2)
    best_client = await endpoint_client(rt, "router", "best_worker_id", count=2)
    by_port = {r.port: r for r in routers}
    ids = [inst.instance_id for inst in generate.instances]
    proc_of = {inst.instance_id: by_port[int(inst.system_url.rsplit(":", 1)[1])] for inst in generate.instances}
    for rid in ids:  # both replicas read the primed worker's cache from its kv_dump
        answer = await poll(lambda r=rid: answer_with_overlap(best_client, PRIME, r), 10.0, "primed prompt indexed")
        assert (answer["worker_id"], answer["overlap_blocks"]) == (primed, PRIME_BLOCKS)
    await _sync_connected_routers(generate, ids[0], proc_of[ids[1]], proc_of[ids[0]])
    await _sync_connected_routers(generate, ids[1], proc_of[ids[0]], proc_of[ids[1]])

    chosen: list[int] = []
    async with AsyncExitStack() as held:
        for i in range(BURST):
            src, dst = ids[i % 2], ids[(i + 1) % 2]
            stream = generate.generate(request(f"burst-{i}", prompt(100 + i, 4), HELD_TOKENS),
                                       instance_id=src, timeout_s=60.0)
            held.push_async_callback(stream.aclose)
            first = await anext(stream)
            chosen.append(first["worker_id"])
            await wait_active(proc_of[dst], i + 1)
        counts = Counter(chosen)
        assert len(counts) == 2 and set(counts.values()) == {BURST // 2}, chosen
        assert chosen[0] != primed  # idle workers: the smaller cache wins
        for k in range(0, BURST, 2):
            assert chosen[k] != chosen[k + 1], (k, chosen)
    # Cancelled streams are freed on the router that routed them and, through sync, on the other.
    for r in routers:
        await wait_active(r, 0)


# ------------------------------------------------------------------------------------------------
# Two frontends: worker header, explain header, router_decisions.


async def _open(http: httpx.AsyncClient, frontend: FrontendProc, tokens: list[int], explain: bool) -> httpx.Response:
    body = {"model": "tiny", "prompt": tokens, "max_tokens": HELD_TOKENS, "stream": True, "ignore_eos": True}
    headers = {"x-dynamo-route-explain": "1"} if explain else {}
    req = http.build_request("POST", frontend.url + "/v1/completions", json=body, headers=headers)
    resp = await http.send(req, stream=True)
    assert resp.status_code == 200, await resp.aread()
    return resp


async def _sync_connected_frontends(http: httpx.AsyncClient, src: FrontendProc, dst: FrontendProc) -> None:
    async def hold(attempt: int) -> Callable[[], Awaitable[None]]:
        resp = await _open(http, src, prompt(600 + attempt, 1), explain=False)
        assert "x-dynamo-route-explain" not in resp.headers  # only when asked
        return resp.aclose

    await _until_replica_counts(hold, src, dst)


async def _frontend_decision(sub_iter: AsyncIterator, timeout: float) -> dict | None:
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await anext(sub_iter)
                data = msgspec.msgpack.decode(msg.payload)
                if data.get("source") == "frontend":
                    return data
    except TimeoutError:
        return None


async def test_two_frontends_spread_a_burst_and_explain(cluster, rt: DistributedRuntime) -> None:
    _c, _r, frontends, primed = cluster
    a, b = frontends
    sub = await rt.events.subscribe(rt.settings.namespace, "*", TOPIC_ROUTER_DECISIONS)
    sub_iter = sub.__aiter__()
    async with httpx.AsyncClient(timeout=30.0) as http:
        for f in frontends:  # both replicas read the primed worker's cache from its kv_dump
            resp = await http.post(f.url + "/v1/completions", headers={"x-dynamo-route-explain": "1"},
                                   json={"model": "tiny", "prompt": PRIME, "max_tokens": 1})
            ex = json.loads(resp.headers["x-dynamo-route-explain"])
            assert (int(ex["worker_id"], 16), ex["overlap_blocks"], ex["request_blocks"]) == (primed, PRIME_BLOCKS, PRIME_BLOCKS), ex
        await _sync_connected_frontends(http, a, b)
        await _sync_connected_frontends(http, b, a)

        chosen: list[int] = []
        explains: list[dict] = []
        async with AsyncExitStack() as held:
            for i in range(BURST):
                src, dst = frontends[i % 2], frontends[(i + 1) % 2]
                resp = await _open(http, src, prompt(200 + i, 4), explain=True)
                held.push_async_callback(resp.aclose)
                chosen.append(int(resp.headers["x-dynamo-worker-instance-id"], 16))
                explains.append(json.loads(resp.headers["x-dynamo-route-explain"]))
                await wait_active(dst, i + 1)
            counts = Counter(chosen)
            assert len(counts) == 2 and set(counts.values()) == {BURST // 2}, chosen
            assert chosen[0] != primed
            for k in range(0, BURST, 2):
                assert chosen[k] != chosen[k + 1], (k, chosen)

            # The header names the winner and every candidate's terms; the second request's
            # header (other frontend) counts the first request on the first request's worker.
            for ex, wid in zip(explains, chosen, strict=True):
                assert int(ex["worker_id"], 16) == wid and ex["candidates_total"] == 2 and len(ex["candidates"]) == 2
                assert all({"overlap_blocks", "prefill_blocks", "decode_blocks", "cost"} <= set(c) for c in ex["candidates"])
            second = {int(c["worker_id"], 16): c for c in explains[1]["candidates"]}
            assert second[chosen[0]]["decode_blocks"] == 2 * second[chosen[1]]["decode_blocks"], explains[1]

        for f in frontends:
            await wait_active(f, 0)

        # Decisions reach the console's topic (the subscription may have joined late: retry).
        decision = await _frontend_decision(sub_iter, 0.5)
        for attempt in range(20):
            if decision is not None:
                break
            resp = await http.post(a.url + "/v1/completions",
                                   json={"model": "tiny", "prompt": prompt(700 + attempt, 1), "max_tokens": 1})
            assert resp.status_code == 200
            decision = await _frontend_decision(sub_iter, 0.5)
    await sub.close()
    assert decision is not None, "no frontend decision arrived on router_decisions"
    assert decision["model"] == "tiny"
    assert decision["worker_id"] in {c["worker_id"] for c in decision["candidates"]}
    assert all({"overlap_blocks", "prefill_blocks", "decode_blocks", "cost"} <= set(c) for c in decision["candidates"])
