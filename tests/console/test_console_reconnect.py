"""A lost etcd or NATS connection is shown, retried and recovered from without restarting the
console: real etcd and nats-server processes are stopped and started under a running console."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import pytest

from dynamod.console.collectors.connection import ClusterConnection
from dynamod.console.settings import ConsoleSettings
from dynamod.console.state.cluster import ClusterState
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.widgets import top_bar_text
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.events.plane import TOPIC_KV_METRICS
from dynamod.shared.protocol.load import LoadMetrics, load_encoder
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.console.pilot import until as pilot_until

pytestmark = pytest.mark.timeout(120)


# A restarted etcd or nats-server takes longer to be seen again than a worker action.
until = functools.partial(pilot_until, timeout=30.0)


async def _echo(body, ctx) -> AsyncIterator[dict]:
    yield {"ok": True}


async def test_console_recovers_from_etcd_and_nats_restarts(etcd_server, nats_server) -> None:
    worker_settings = RuntimeSettings(namespace="dynamo", discovery_backend="etcd", etcd_endpoints=[etcd_server.endpoint],
                                      event_plane="nats", nats_server=nats_server.url)
    worker = await DistributedRuntime.create(worker_settings)
    try:
        backend = worker.namespace("dynamo").component("backend")
        served = await backend.endpoint("generate").serve(_echo, role="agg", model="m")
        pub = await backend.publisher(TOPIC_KV_METRICS)
        wid = served.instance_id

        settings = ConsoleSettings(discovery="etcd", etcd_endpoints=[etcd_server.endpoint], nats_server=nats_server.url,
                                   frontend_urls=[], probe_interval_s=0.3, retry_max_s=1.0)
        state = ClusterState()
        app = ConsoleApp(state, connection=ClusterConnection(settings, state), refresh_s=0.1)

        def running() -> int | None:
            w = state.find_worker(wid)
            return w.stats.running if w is not None and w.stats.loads else None

        async with app.run_test(size=(100, 24)) as pilot:
            await until(pilot, lambda: state.find_worker(wid) is not None, what="the worker")
            await until(pilot, lambda: state.connections.get("events") and state.connections["events"].state == "ok", what="events ok")

            async def publish_until(value: int) -> None:
                for _ in range(200):
                    await pub.publish(TOPIC_KV_METRICS, load_encoder.encode(LoadMetrics(worker_id=wid, num_running=value)))
                    if running() == value:
                        return
                    await pilot.pause(0.1)
                raise AssertionError(f"load {value} never reached the console")

            await publish_until(3)

            # etcd goes away: shown as lost, in the top bar and as an error event.
            await asyncio.to_thread(etcd_server.stop)
            await until(pilot, lambda: state.connections["discovery"].state == "lost", what="discovery lost")
            assert "lost" in top_bar_text(state, read_only=False, width=100).plain
            assert state.recent_events(kinds=["connection"])[0].severity == "error"
            await asyncio.to_thread(etcd_server.start)
            await until(pilot, lambda: state.connections["discovery"].state == "ok", what="discovery recovered")
            assert "recovered" in state.recent_events(kinds=["connection"])[0].message
            # The watch resumed: a change made after the restart reaches the console.
            await served.set_status("draining")
            await until(pilot, lambda: state.find_worker(wid).status == "draining", timeout=30, what="draining after recovery")

            # NATS goes away and comes back: shown, and load flows again.
            await asyncio.to_thread(nats_server.stop)
            await until(pilot, lambda: state.connections["events"].state == "lost", what="events lost")
            await asyncio.to_thread(nats_server.start)
            await until(pilot, lambda: state.connections["events"].state == "ok", what="events recovered")
            await publish_until(9)
    finally:
        await worker.shutdown(grace_s=0.0)


async def test_console_started_before_etcd_connects_when_it_comes_up(etcd_server) -> None:
    """No etcd at start: the console shows why, keeps retrying, and fills in once etcd is up."""
    await asyncio.to_thread(etcd_server.stop)
    settings = ConsoleSettings(discovery="etcd", etcd_endpoints=[etcd_server.endpoint], event_plane="zmq",
                               frontend_urls=[], probe_interval_s=0.3, retry_max_s=0.5)
    state = ClusterState()
    app = ConsoleApp(state, connection=ClusterConnection(settings, state), refresh_s=0.1)
    async with app.run_test(size=(100, 24)) as pilot:
        await until(pilot, lambda: state.connections.get("discovery") and state.connections["discovery"].state == "lost",
                    what="discovery lost at start")
        assert state.connections["discovery"].detail  # the reason is shown, not just "lost"
        await asyncio.to_thread(etcd_server.start)
        await until(pilot, lambda: state.connections["discovery"].state == "ok", what="connected once etcd is up")
        worker = await DistributedRuntime.create(
            RuntimeSettings(namespace="dynamo", discovery_backend="etcd", etcd_endpoints=[etcd_server.endpoint], event_plane="zmq"),
            events=False,
        )
        try:
            served = await worker.namespace("dynamo").component("backend").endpoint("generate").serve(_echo, role="agg")
            await until(pilot, lambda: state.find_worker(served.instance_id) is not None, what="the worker")
        finally:
            await worker.shutdown(grace_s=0.0)
