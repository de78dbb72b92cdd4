"""Request-plane liveness: frozen and hung servers are found by the heartbeat, instances that leave
discovery fail their streams at once, and a graceful stop fails nothing.

The frozen server is a real child process stopped with SIGSTOP (its kernel keeps answering TCP, so
keep-alive cannot tell); the hung one blocks its own event loop with ``time.sleep`` in a handler.
Both must be given up on within the heartbeat timeout (plus one interval, plus scheduling margin),
while a handler that is merely quiet for several timeouts (a long prefill) must live.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from msgspec import UNSET
from prometheus_client import CollectorRegistry

from dynamod.shared.config import RuntimeSettings, add_runtime_args, settings_from_args
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import ConfigError, TransportError
from dynamod.shared.runtime.client import InstanceGoneError
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.transport import tcp_server
from dynamod.shared.transport.framing import (
    DEFAULT_WINDOW_FRAMES,
    ClientFrame,
    FrameReader,
    MalformedFrame,
    ServerFrame,
    encode_frame,
)
from dynamod.shared.transport.liveness import HeartbeatConfig, RequestPlaneMetrics
from dynamod.shared.transport.nats_client import NatsRequestClient
from dynamod.shared.transport.plane import RequestContext, ServerAddress
from dynamod.shared.transport.tcp_client import TcpRequestClient
from dynamod.shared.transport.tcp_server import TcpRequestServer
from tests.fixtures.servers import NatsServer
from tests.integration.request_plane.helpers_transport import ServerProcess

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[3]
HB = HeartbeatConfig(interval_s=0.2, timeout_s=1.0)
# Detection is due between ``timeout`` and ``timeout + interval`` after the last byte; the margin
# covers a loaded CI machine's scheduling.
DETECT_MAX_S = HB.timeout_s + HB.interval_s + 1.0

CHILD = r"""
import asyncio, json, os, signal, sys, time
from dynamod.shared.transport.tcp_server import TcpRequestServer

finished = {}

async def paced(body, ctx):
    try:
        for i in range(int(body["n"])):
            if i:
                await asyncio.sleep(float(body["interval_s"]))
            yield i
    finally:
        finished[ctx.request_id] = True

async def block(body, ctx):
    yield "started"
    await asyncio.sleep(0.1)  # let "started" leave before the loop hangs
    time.sleep(float(body))  # a hung event loop: nothing else in this process runs meanwhile
    yield "done"

async def main():
    server = TcpRequestServer()
    server.register("t/paced", paced)
    server.register("t/block", block)

    async def stats(body, ctx):
        yield {**server.stats(), "finished": list(finished), "inflight": server.inflight - 1}

    server.register("t/stats", stats)
    address = await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    sys.stdout.write(json.dumps({"address": address.address, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    await stop.wait()
    await server.stop(grace_s=1)

asyncio.run(main())
"""


class Child:
    """The server above in its own process (so it can be frozen or hung on its own)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(20):
                raise TimeoutError("child server printed nothing within 20s")
        line = json.loads(self.proc.stdout.readline())
        self.address = ServerAddress("tcp", line["address"])

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
async def client() -> AsyncIterator[tuple[TcpRequestClient, RequestPlaneMetrics, CollectorRegistry]]:
    registry = CollectorRegistry()
    metrics = RequestPlaneMetrics(registry)
    c = TcpRequestClient(heartbeat=HB, metrics=metrics)
    try:
        yield c, metrics, registry
    finally:
        await c.close()


def _dead_count(registry: CollectorRegistry, transport: str = "tcp") -> float:
    value = registry.get_sample_value(
        "dynamo_component_request_plane_dead_connections_total",
        {"transport": transport, "reason": "heartbeat_timeout"},
    )
    return value or 0.0


async def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


async def _stats(client: TcpRequestClient, address: ServerAddress) -> dict[str, Any]:
    return [x async for x in client.stream(address, "t/stats", None, timeout_s=5)][0]


async def _fails_within(stream: Any, limit_s: float) -> tuple[type[BaseException], float]:
    """Reads ``stream`` to its error; returns the error's class and how long it took."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(limit_s):
            async for _ in stream:
                pass
    except TransportError as exc:
        return type(exc), time.monotonic() - start
    raise AssertionError("the stream ended without an error")


# -- frozen and hung servers ---------------------------------------------------------------------


async def test_sigstopped_server_fails_its_streams_within_the_timeout_then_serves_after_sigcont(
    child: Child, client: tuple[TcpRequestClient, RequestPlaneMetrics, CollectorRegistry]
) -> None:
    c, _, registry = client
    rid = f"frozen-{time.monotonic_ns()}"
    stream = c.stream(child.address, "t/paced", {"n": 100_000, "interval_s": 0.01}, request_id=rid)
    it = stream.__aiter__()
    for _ in range(5):
        await it.__anext__()
    child.signal(signal.SIGSTOP)
    try:
        kind, took = await _fails_within(stream, 10)
    finally:
        child.signal(signal.SIGCONT)
    assert kind is TransportError
    # The last byte arrived just before the stop (paced every 10 ms): detection is timeout-bound.
    assert HB.timeout_s - 0.05 <= took <= DETECT_MAX_S, took
    assert _dead_count(registry) == 1
    assert c.connection_count() == 0  # forgotten at once: the next stream dials afresh
    # Thawed: the same address serves again over a new connection, and the server let go of the
    # stream whose connection the client dropped (no handler left running for nobody).
    assert [x async for x in c.stream(child.address, "t/paced", {"n": 3, "interval_s": 0})] == [0, 1, 2]

    async def released() -> bool:
        s = await _stats(c, child.address)
        return rid in s["finished"] and s["inflight"] == 0 and s["connections"] == 1

    await _wait_for(released, 10, "the thawed server to drop the dead connection's stream")
    assert child.proc.poll() is None


async def test_hung_event_loop_fails_every_stream_on_the_connection(
    child: Child, client: tuple[TcpRequestClient, RequestPlaneMetrics, CollectorRegistry]
) -> None:
    c, _, registry = client
    busy = c.stream(child.address, "t/paced", {"n": 100_000, "interval_s": 0.01})
    busy_it = busy.__aiter__()
    await busy_it.__anext__()
    hung = c.stream(child.address, "t/block", 4.0)
    hung_it = hung.__aiter__()
    assert await hung_it.__anext__() == "started"  # from here the server's loop sleeps for 4 s
    results = await asyncio.gather(_fails_within(hung, 10), _fails_within(busy, 10))
    for kind, took in results:
        assert kind is TransportError
        assert took <= DETECT_MAX_S, took
    assert _dead_count(registry) == 1  # one connection, declared dead once

    # Once its loop runs again the server is served again (a fresh connection).
    async def serving() -> bool:
        try:
            return [x async for x in c.stream(child.address, "t/paced", {"n": 2, "interval_s": 0})] == [0, 1]
        except TransportError:
            return False

    await _wait_for(serving, 15, "the unblocked server to serve again")


async def test_nats_sigstopped_server_fails_its_streams_within_the_timeout() -> None:
    """NATS has no connection per server to ping; the server's loop heartbeats each quiet stream,
    so a frozen server falls silent and the client's per-stream watchdog gives up on it."""
    nats = NatsServer(jetstream=False).start()
    proc = ServerProcess("nats", nats_url=nats.url).start()
    registry = CollectorRegistry()
    client = NatsRequestClient(
        nats.url, heartbeat_s=HB.interval_s, silence_timeout_s=HB.timeout_s, metrics=RequestPlaneMetrics(registry)
    )
    assert proc.proc is not None and proc.address is not None
    try:
        stream = client.stream(proc.address, "test/paced", {"n": 100_000, "interval_s": 0.01})
        it = stream.__aiter__()
        for _ in range(5):
            await it.__anext__()
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            kind, took = await _fails_within(stream, 10)
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        assert kind is TransportError
        assert HB.timeout_s - 0.05 <= took <= DETECT_MAX_S, took
        assert _dead_count(registry, "nats") == 1
        assert [x async for x in client.stream(proc.address, "test/paced", {"n": 2, "interval_s": 0})] == [0, 1]
    finally:
        await client.close()
        proc.cleanup()
        nats.cleanup()


# -- healthy peers stay up -----------------------------------------------------------------------


async def test_a_handler_quiet_for_several_timeouts_is_not_killed(
    client: tuple[TcpRequestClient, RequestPlaneMetrics, CollectorRegistry],
) -> None:
    c, _, registry = client

    async def long_prefill(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        await asyncio.sleep(float(body))  # no token for 3 timeouts, but the loop answers pings
        yield "first token"

    server = TcpRequestServer()
    server.register("t/prefill", long_prefill)
    address = await server.start()
    try:
        out = [x async for x in c.stream(address, "t/prefill", 3 * HB.timeout_s)]
        assert out == ["first token"]
        conn = c._conns[address.address]
        assert conn._pong_seen and conn._pings_sent >= 10
        assert _dead_count(registry) == 0

        # Idle again: the connection's only timer stops until the next stream opens.
        async def timer_stopped() -> bool:
            return conn._hb_handle is None

        await _wait_for(timer_stopped, 2, "the idle connection's heartbeat timer to stop")
    finally:
        await server.stop(0)


async def test_old_server_without_ping_keeps_the_connection(
    monkeypatch: pytest.MonkeyPatch, client: tuple[TcpRequestClient, RequestPlaneMetrics, CollectorRegistry]
) -> None:
    """A server from before the heartbeat: a ping decodes as a frame with nothing in it, which it
    answered with a connection-level protocol error (and kept the connection)."""
    c, _, registry = client
    original = tcp_server._ServerConnection._on_frame

    def old_on_frame(self: Any, frame: ClientFrame) -> None:
        if frame.ping is not UNSET:
            self._on_malformed(
                MalformedFrame(frame.stream_id or None, "frame is neither a request, a window update nor a cancel")
            )
            return
        original(self, frame)

    monkeypatch.setattr(tcp_server._ServerConnection, "_on_frame", old_on_frame)

    async def paced(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        for i in range(int(body)):
            await asyncio.sleep(HB.interval_s / 2)
            yield i

    server = TcpRequestServer()
    server.register("t/paced", paced)
    address = await server.start()
    try:
        n = int(4 * HB.timeout_s / (HB.interval_s / 2))  # several timeouts long
        assert [x async for x in c.stream(address, "t/paced", n)] == list(range(n))
        conn = c._conns[address.address]
        assert not conn._pinging and conn._pings_sent == 1  # one try, then keep-alive only
        assert c.connection_count() == 1 and _dead_count(registry) == 0
    finally:
        await server.stop(0)


async def test_old_client_that_never_pings_gets_no_pong() -> None:
    async def paced(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        for i in range(int(body)):
            await asyncio.sleep(0.02)
            yield i

    server = TcpRequestServer()
    server.register("t/paced", paced)
    address = await server.start()
    try:
        host, port = address.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(encode_frame(ClientFrame(1, endpoint="t/paced", body=20, credit=DEFAULT_WINDOW_FRAMES), 1 << 20))
        frames: list[ServerFrame] = []
        decoder: FrameReader[ServerFrame] = FrameReader(ServerFrame, 1 << 20)
        async with asyncio.timeout(10):
            while not frames or frames[-1].end is not True:
                frames += [f for f in decoder.feed(await reader.read(65536)) if isinstance(f, ServerFrame)]
        assert [f.data for f in frames[:-1]] == list(range(20))
        assert all(f.pong is UNSET for f in frames)
        writer.close()
        await writer.wait_closed()
    finally:
        await server.stop(0)


# -- frozen clients ------------------------------------------------------------------------------

CLIENT_CHILD = r"""
import asyncio, sys
from dynamod.shared.transport.liveness import HeartbeatConfig
from dynamod.shared.transport.plane import ServerAddress
from dynamod.shared.transport.tcp_client import TcpRequestClient

async def main():
    client = TcpRequestClient(heartbeat=HeartbeatConfig(float(sys.argv[2]), float(sys.argv[3])))
    async for item in client.stream(ServerAddress("tcp", sys.argv[1]), "t/paced", None, request_id="from-child"):
        if item == 5:
            print("reading", flush=True)

asyncio.run(main())
"""


async def _paced_server(silent_s: float) -> tuple[TcpRequestServer, ServerAddress, dict[str, float], CollectorRegistry]:
    """A server whose ``t/paced`` streams a number every 10 ms for ever and records when each
    request's handler ended (``ended[request_id]``)."""
    ended: dict[str, float] = {}

    async def paced(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        try:
            i = 0
            while True:
                yield i
                i += 1
                await asyncio.sleep(0.01)
        finally:
            ended[ctx.request_id] = time.monotonic()

    registry = CollectorRegistry()
    server = TcpRequestServer(
        limits=tcp_server.ConnectionLimits(silent_client_timeout_s=silent_s), metrics=RequestPlaneMetrics(registry)
    )
    server.register("t/paced", paced)
    return server, await server.start(), ended, registry


async def test_sigstopped_client_has_its_streams_cancelled_by_the_server() -> None:
    """A frontend frozen mid-stream must not hold the worker's slot for ever: the worker sees its
    pings stop and aborts the connection, which ends the handler (the engine frees the request)."""
    server, address, ended, registry = await _paced_server(HB.timeout_s)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT_CHILD, address.address, str(HB.interval_s), str(HB.timeout_s),
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.strip() == b"reading"
        await asyncio.sleep(3 * HB.interval_s)  # a few pings reach the server first
        assert "from-child" not in ended
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()

        async def cancelled() -> bool:
            return "from-child" in ended

        await _wait_for(cancelled, 10, "the server to give up on the frozen client")
        took = ended["from-child"] - stopped
        assert took <= DETECT_MAX_S + HB.timeout_s / 4, took
        assert _dead_count(registry) == 1
        assert server.stats()["connections"] == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # thawed, it may already have ended
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        await proc.wait()
        await server.stop(0)


async def test_silent_client_without_heartbeat_keeps_its_stream() -> None:
    """A client that never pinged runs no heartbeat: its silence proves nothing, so its stream
    lives on (a paused reader: the server waits for credit)."""
    server, address, ended, registry = await _paced_server(HB.timeout_s)
    try:
        host, port = address.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(encode_frame(ClientFrame(1, endpoint="t/paced", body=None, credit=4), 1 << 20))
        await writer.drain()
        await asyncio.sleep(3 * HB.timeout_s)  # the window runs out; nothing more from the client
        assert ended == {} and _dead_count(registry) == 0
        assert server.stats()["connections"] == 1
        writer.close()
        await writer.wait_closed()
    finally:
        await server.stop(0)


async def test_client_that_stops_pinging_is_cut_but_a_pinging_one_is_not() -> None:
    """Two raw clients with an exhausted window: the one that keeps pinging keeps its stream, the
    one that pinged and then fell silent loses it within the timeout."""
    server, address, ended, registry = await _paced_server(HB.timeout_s)
    host, port = address.address.rsplit(":", 1)
    try:
        conns = []
        for sid in (1, 2):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(encode_frame(ClientFrame(sid, endpoint="t/paced", body=None, credit=4), 1 << 20))
            conns.append((reader, writer))
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < 3 * HB.timeout_s:
            n += 1
            for index, (_, writer) in enumerate(conns):
                if index == 0 or n <= 3:  # the second stops after three pings
                    writer.write(encode_frame(ClientFrame(0, ping=n), 1 << 20))
            await asyncio.sleep(HB.interval_s)
        assert len(ended) == 1 and _dead_count(registry) == 1
        assert server.stats()["connections"] == 1
        for _, writer in conns:
            writer.close()
    finally:
        await server.stop(0)


# -- settings ------------------------------------------------------------------------------------


def test_heartbeat_settings_come_from_flags_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    monkeypatch.setenv("DYN_REQUEST_PLANE_HEARTBEAT_INTERVAL", "0.5")
    monkeypatch.setenv("DYN_REQUEST_PLANE_HEARTBEAT_TIMEOUT", "3")
    s = settings_from_args(parser.parse_args(["--discovery-backend", "mem"]))
    assert s.request_plane_heartbeat == HeartbeatConfig(0.5, 3.0)
    s = settings_from_args(parser.parse_args(["--request-plane-heartbeat-timeout", "7"]))
    assert s.request_plane_heartbeat == HeartbeatConfig(0.5, 7.0)
    with pytest.raises(ConfigError):
        settings_from_args(parser.parse_args(["--request-plane-heartbeat-timeout", "0.6"]))
    s = settings_from_args(parser.parse_args(["--request-plane-heartbeat-interval", "0"]))
    assert not s.request_plane_heartbeat.enabled


# -- instances leaving discovery, and a graceful stop --------------------------------------------


class SharedMemStore(MemStore):
    """One discovery for two runtimes in this process: a runtime's shutdown must not close it."""

    async def close(self) -> None:
        return None

    async def really_close(self) -> None:
        await super().close()


@contextlib.asynccontextmanager
async def _runtimes() -> AsyncIterator[tuple[SharedMemStore, DistributedRuntime, DistributedRuntime]]:
    """A serving and a calling runtime on one shared discovery; on exit both shut down and the store closes."""
    store = SharedMemStore()
    settings = RuntimeSettings(discovery_backend="mem", event_plane="zmq", request_plane_heartbeat_interval_s=0.2,
                               request_plane_heartbeat_timeout_s=1.0)
    server_rt = await DistributedRuntime.create(settings, store=store, events=False)
    client_rt = await DistributedRuntime.create(settings, store=store, events=False)
    try:
        yield store, server_rt, client_rt
    finally:
        await client_rt.shutdown(0)
        await server_rt.shutdown(0)
        await store.really_close()


def _paced_handler(finished: dict[str, bool]) -> Any:
    async def paced(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        try:
            for i in range(int(body["n"])):
                await asyncio.sleep(float(body["interval_s"]))
                yield i
        finally:
            finished[ctx.request_id] = True

    return paced


async def test_instance_leaving_discovery_fails_its_streams_at_once_but_draining_does_not() -> None:
    async with _runtimes() as (store, server_rt, client_rt):
        finished: dict[str, bool] = {}
        served = await server_rt.namespace("ns").component("c").endpoint("gen").serve(_paced_handler(finished))
        client = await client_rt.namespace("ns").component("c").endpoint("gen").client()
        await client.wait_for_instances(1)
        stream = client.generate({"n": 100_000, "interval_s": 0.01}, request_id="gone-1")
        it = stream.__aiter__()
        await it.__anext__()
        await served.set_status("draining")  # a status change: the stream goes on

        async def draining_seen() -> bool:
            inst = client.instance_set.get(served.instance_id)
            return inst is not None and inst.status == "draining"

        await _wait_for(draining_seen, 5, "the client to see the instance draining")
        for _ in range(5):
            await it.__anext__()
        await store.delete(served.key)  # the record goes (as when the lease ends)
        start = time.monotonic()
        with pytest.raises(InstanceGoneError):
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
        assert time.monotonic() - start < HB.timeout_s  # at once, not when the connection breaks
        assert issubclass(InstanceGoneError, TransportError)  # migratable

        async def handler_released() -> bool:
            return "gone-1" in finished and server_rt.inflight == 0

        await _wait_for(handler_released, 5, "the cancel to reach the handler")
        await client.close()


async def test_graceful_shutdown_keeps_the_instance_until_its_streams_finish() -> None:
    """With instance removal failing streams, deleting the record before draining (the old order)
    would migrate every stream a stopping worker was about to finish."""
    async with _runtimes() as (store, server_rt, client_rt):
        served = await server_rt.namespace("ns").component("c").endpoint("gen").serve(_paced_handler({}))
        client = await client_rt.namespace("ns").component("c").endpoint("gen").client()
        await client.wait_for_instances(1)
        stream = client.generate({"n": 40, "interval_s": 0.02})
        it = stream.__aiter__()
        first = await it.__anext__()
        stopping = asyncio.create_task(server_rt.shutdown(grace_s=10))

        async def draining_seen() -> bool:
            inst = client.instance_set.get(served.instance_id)
            return inst is not None and inst.status == "draining"

        await _wait_for(draining_seen, 5, "the stopping instance to be marked draining")
        rest = [x async for x in stream]
        assert [first, *rest] == list(range(40))
        await stopping

        async def gone() -> bool:
            return client.instance_set.get(served.instance_id) is None

        await _wait_for(gone, 5, "the stopped instance to leave discovery")
        await client.close()
