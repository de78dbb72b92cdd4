"""Worker faults under concurrent streaming load, with real processes: no request lost or cut short.

A frontend and mocker workers (file discovery, TCP request plane) serve concurrent streams that
last a few seconds. Each stream asks for ``max_tokens`` with ``ignore_eos`` and counts the token ids
it receives (vLLM's ``return_token_ids``), so a token lost or sent twice across a migration shows.

- SIGSTOP: the frozen worker's kernel keeps answering TCP, so only the request plane's heartbeat
  finds it. Its streams must resume on the other worker within the heartbeat timeout (plus margin),
  and after SIGCONT the frontend routes to it again.
- kill -9: the connection drops; every stream completes on the survivor.
- SIGTERM: a graceful stop drains: its streams finish where they are, with no migration at all.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster, get_text

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

STREAMS = 12
MAX_TOKENS = 300
SPEEDUP = 0.5  # about 30 ms a token: a stream lasts several seconds, longer than the failover
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 2.0
# The lease outlives the freeze, so the heartbeat (not the lease) must be what finds the worker;
# the quarantine after a dead connection is one TTL + 1 s, which bounds the wait after SIGCONT.
LEASE_TTL_S = 6.0
# Failover: the timeout, one heartbeat interval, then re-prefill on the survivor, with CI margin.
FAILOVER_MAX_S = HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S + 3.0
IN_FLIGHT_S = 0.5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("chaos-cluster"), lease_ttl=LEASE_TTL_S, speedup=SPEEDUP)
    try:
        c.start_worker()
        c.start_worker()
        c.start_frontend(
            "--request-plane-heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
            "--request-plane-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
        )
        c.wait_ready(2)
        yield c
    finally:
        for proc in c.workers:
            if proc.alive():
                proc.popen.send_signal(signal.SIGCONT)  # a frozen worker cannot act on SIGTERM
        c.stop()


def _ensure_two_workers(cluster: LocalCluster) -> None:
    """Tests share the cluster; each starts with two ready workers, starting one if needed."""
    alive = sum(1 for p in cluster.workers if p.alive())
    for _ in range(2 - alive):
        cluster.start_worker()
    wait_until(lambda: len(cluster.ready_workers()) >= 2, 60, interval=0.1, what="two ready workers")


class Load:
    """``STREAMS`` concurrent streaming completions, recording when each token arrived."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.progress = [0] * STREAMS
        self.workers = [""] * STREAMS
        self.arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
        self.tasks: list[asyncio.Task[tuple[int, int, str]]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._stream(i)) for i in range(STREAMS)]

    async def _stream(self, index: int) -> tuple[int, int, str]:
        async with self.api.completions.with_streaming_response.create(
            model="tiny", prompt=f"chaos stream {index} tells a long story", max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
        ) as response:
            self.workers[index] = response.headers["x-dynamo-worker-instance-id"]
            received, usage_tokens, finish = 0, -1, ""
            async for chunk in await response.parse():
                if chunk.choices:
                    choice = chunk.choices[0]
                    got = len(getattr(choice, "token_ids", None) or [])
                    if got:
                        received += got
                        self.progress[index] = received
                        self.arrivals[index].append(time.monotonic())
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
        return received, usage_tokens, finish

    async def all_started(self, tokens: int = 5) -> None:
        async def started() -> None:
            while min(self.progress) < tokens:  # noqa: ASYNC110 - polled under the deadline below
                if any(t.done() for t in self.tasks):
                    break
                await asyncio.sleep(0.01)

        await asyncio.wait_for(started(), 60)
        assert not any(t.done() for t in self.tasks), "streams ended before the fault; slow the mocker down"

    async def results(self) -> list[tuple[int, int, str]]:
        try:
            return await asyncio.gather(*self.tasks)
        finally:
            await self.api.close()

    def assert_complete(self, results: list[tuple[int, int, str]]) -> None:
        for index, (received, usage_tokens, finish) in enumerate(results):
            assert (received, usage_tokens, finish) == (MAX_TOKENS, MAX_TOKENS, "length"), f"stream {index}"


def _victim(cluster: LocalCluster, load: Load) -> tuple[str, object]:
    victim = load.workers[0]
    pid = cluster.instance_pid(victim)
    proc = next(p for p in cluster.workers if p.pid == pid)
    return victim, proc


async def _stop_a_loaded_worker(cluster: LocalCluster, stop: Callable[[Any], object]) -> object:
    """Runs the load, applies ``stop`` to the worker of the first stream once every stream has started,
    and checks that every stream still completed; returns that worker's process."""
    load = Load(cluster)
    load.start()
    await load.all_started()
    _, proc = _victim(cluster, load)
    stop(proc)
    load.assert_complete(await load.results())
    return proc


def _metric(cluster: LocalCluster, name: str) -> float:
    text = get_text(cluster.url + "/metrics")
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M))


def _served_by(cluster: LocalCluster) -> str:
    api = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=30)
    response = api.completions.with_raw_response.create(
        model="tiny", prompt="are you back?", max_tokens=2, extra_body={"ignore_eos": True}
    )
    return response.headers["x-dynamo-worker-instance-id"]


def test_sigstopped_worker_fails_over_within_the_heartbeat_timeout_and_serves_after_sigcont(
    cluster: LocalCluster,
) -> None:
    _ensure_two_workers(cluster)
    dead_before = _metric(cluster, "dynamo_component_request_plane_dead_connections_total")

    async def run() -> tuple[str, float]:
        load = Load(cluster)
        load.start()
        await load.all_started()
        victim, proc = _victim(cluster, load)
        on_victim = [i for i, w in enumerate(load.workers) if w == victim]
        frozen_at = time.monotonic()
        proc.popen.send_signal(signal.SIGSTOP)  # type: ignore[attr-defined]
        try:
            # Failed over: every stream of the frozen worker gets tokens again. Bytes already on
            # their way when it froze arrive within milliseconds; anything after IN_FLIGHT_S can
            # only come from the survivor.
            after = frozen_at + IN_FLIGHT_S

            async def resumed() -> None:
                while not all(load.arrivals[i][-1] > after for i in on_victim):  # noqa: ASYNC110
                    if any(t.done() for t in load.tasks):
                        break
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(resumed(), FAILOVER_MAX_S + 10)
            failover_s = max(next(t for t in load.arrivals[i] if t > after) for i in on_victim) - frozen_at
        finally:
            proc.popen.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]
        load.assert_complete(await load.results())
        return victim, failover_s

    migrations_before = _metric(cluster, "dynamo_frontend_model_migration_total")
    victim, failover_s = asyncio.run(run())
    print(f"sigstop failover_s={failover_s:.2f}")
    # Not before the timeout (the heartbeat, not something else, found it), not long after.
    assert HEARTBEAT_TIMEOUT_S - 0.1 <= failover_s <= FAILOVER_MAX_S, failover_s
    assert _metric(cluster, "dynamo_frontend_model_migration_total") > migrations_before
    assert _metric(cluster, "dynamo_component_request_plane_dead_connections_total") >= dead_before + 1
    # Thawed: it is routed to again (the dead connection left nothing behind; the quarantine ends).
    wait_until(lambda: _served_by(cluster) == victim, 30, interval=0.2, what="the thawed worker to be routed to again")
    assert all(p.alive() for p in cluster.workers)


def test_killed_worker_under_load_loses_no_request(cluster: LocalCluster) -> None:
    _ensure_two_workers(cluster)
    migrations_before = _metric(cluster, "dynamo_frontend_model_migration_total")
    asyncio.run(_stop_a_loaded_worker(cluster, lambda proc: proc.kill9()))
    assert _metric(cluster, "dynamo_frontend_model_migration_total") > migrations_before


def test_sigterm_drains_without_migrating(cluster: LocalCluster) -> None:
    """A graceful stop keeps the worker registered (draining) until its streams finished, so the
    frontend, which fails streams to an instance the moment it leaves discovery, migrates none."""
    _ensure_two_workers(cluster)
    migrations_before = _metric(cluster, "dynamo_frontend_model_migration_total")
    proc = asyncio.run(_stop_a_loaded_worker(cluster, lambda proc: proc.popen.send_signal(signal.SIGTERM)))
    assert _metric(cluster, "dynamo_frontend_model_migration_total") == migrations_before
    wait_until(lambda: not proc.alive(), 30, what="the stopped worker to exit")  # type: ignore[attr-defined]
    assert proc.popen.returncode == 0  # type: ignore[attr-defined]
