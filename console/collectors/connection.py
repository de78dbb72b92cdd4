"""The console's connection to a cluster: one runtime, its collectors, and their recovery.

``ClusterConnection.run()`` keeps the picture live for as long as the console runs: it creates the
runtime (retrying with capped backoff while discovery is unreachable), starts the discovery, event
and frontend collectors and the KV seeder (``kv_dump``), probes discovery and the event plane every couple of seconds and reports
each as a connection state (``connecting``, ``ok``, ``lost``) in the ``ClusterState``. A collector
that fails is restarted on its own; nothing here needs the console to be restarted.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from dynamod.console.collectors.discovery import DiscoveryCollector
from dynamod.console.collectors.events import EventCollector
from dynamod.console.collectors.kv_seed import KvSeeder
from dynamod.console.collectors.scraper import FrontendScraper, frontend_metric_urls
from dynamod.console.settings import ConsoleSettings
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import StateSink
from dynamod.shared.errors import DynamoError

if TYPE_CHECKING:
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

PROBE_KEY = "v1/console/probe"
_RETRY_MIN_S = 0.25

RuntimeFactory = Callable[[ConsoleSettings], Awaitable["DistributedRuntime"]]


async def create_runtime(settings: ConsoleSettings) -> DistributedRuntime:
    from dynamod.shared.runtime.distributed import DistributedRuntime

    return await DistributedRuntime.create(settings.runtime_settings(), events=True)


class ClusterConnection:
    def __init__(
        self,
        settings: ConsoleSettings,
        state: ClusterState,
        sink: StateSink | None = None,
        *,
        runtime_factory: RuntimeFactory = create_runtime,
        scrape: bool = True,
        tick: bool = True,
        seed_kv: bool = True,
    ) -> None:
        self.settings = settings
        self.state = state
        self.sink: StateSink = sink if sink is not None else state
        self._factory = runtime_factory
        self._scrape = scrape
        self._tick = tick
        self._seed_kv = seed_kv
        self.kv_seeder: KvSeeder | None = None
        self.runtime: DistributedRuntime | None = None
        self.events: EventCollector | None = None
        self.scraper: FrontendScraper | None = None
        self._ready = asyncio.Event()
        self._synced = asyncio.Event()

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def wait_ready(self, timeout: float) -> DistributedRuntime:
        """Waits until the runtime exists and the first discovery listing is in the state."""
        await asyncio.wait_for(self._synced.wait(), timeout)
        assert self.runtime is not None
        return self.runtime

    async def run(self) -> None:
        """Runs until cancelled; on cancel shuts the runtime down."""
        target = self.settings.discovery_target()
        self.sink.set_connection("discovery", "connecting", target=target)
        delay = _RETRY_MIN_S
        try:
            while self.runtime is None:
                try:
                    self.runtime = await self._factory(self.settings)
                except (DynamoError, OSError) as exc:
                    self.sink.set_connection("discovery", "lost", target=target, detail=str(exc))
                    logger.warning("console cannot connect target=%s error=%s retry_s=%.1f", target, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.settings.retry_max_s)
            self.sink.set_connection("discovery", "ok", target=target)
            self._ready.set()
            await self._run_collectors(self.runtime)
        finally:
            await self._shutdown()

    async def _run_collectors(self, rt: DistributedRuntime) -> None:
        assert rt.events is not None, "the console's runtime is created with an event plane"
        self.events = EventCollector(rt.events, self.sink, retry_max_s=self.settings.retry_max_s)
        if self.settings.namespace:
            self.events.ensure_namespace(self.settings.namespace)
        events_target = self.settings.nats_server if self.settings.resolved_event_plane == "nats" else "zmq"
        self.sink.set_connection("events", "ok", target=events_target)
        discovery = DiscoveryCollector(
            rt.store,
            self.sink,
            namespace=self.settings.namespace,
            on_namespace=self.events.ensure_namespace,
            on_synced=self._synced.set,
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._supervise("discovery", discovery.run))
            tg.create_task(self._probe(rt, events_target))
            if self._scrape:
                self.scraper = FrontendScraper(
                    self.sink,
                    lambda: frontend_metric_urls(self.state, self.settings.frontend_urls),
                    interval_s=self.settings.scrape_interval_s,
                    token=self.settings.security.request_plane.token,  # members' /metrics need it
                    api_key=self.settings.api_key,  # a frontend with API keys takes one of them too
                    api_key_source=self.settings.api_key_source,
                    ca_file=self.settings.frontend_ca_file,
                    guessed=self.settings.guessed_frontend_urls,
                )
                tg.create_task(self._scrape_after_sync(self.scraper))
            if self._seed_kv:
                self.kv_seeder = KvSeeder(rt, self.state, self.sink)
                tg.create_task(self._seed_after_sync(self.kv_seeder))
            if self._tick:
                tg.create_task(self._ticker())

    async def _scrape_after_sync(self, scraper: FrontendScraper) -> None:
        """Scrapes once discovery is listed: a round before it knows no registered frontend, and
        ``dynamoctl status`` takes the first round's figures (or reasons) as the answer."""
        await self._synced.wait()
        await self._supervise("scraper", scraper.run)

    async def _seed_after_sync(self, seeder: KvSeeder) -> None:
        """Seeds cached-block counts from ``kv_dump`` once the workers are listed."""
        await self._synced.wait()
        try:
            await self._supervise("kv-seed", seeder.run)
        finally:
            await seeder.close()

    async def _supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Runs a collector forever: a failure is shown and the collector is started again."""
        delay = _RETRY_MIN_S
        while True:
            try:
                await run()
                return
            except (DynamoError, OSError, TimeoutError) as exc:
                if name == "discovery":
                    self.sink.set_connection("discovery", "lost", detail=str(exc))
                logger.warning("console collector failed name=%s error=%s retry_s=%.1f", name, exc, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.settings.retry_max_s)

    async def _probe(self, rt: DistributedRuntime, events_target: str) -> None:
        target = self.settings.discovery_target()
        while True:
            try:
                await asyncio.wait_for(rt.store.get(PROBE_KEY), timeout=max(1.0, self.settings.probe_interval_s))
                self.sink.set_connection("discovery", "ok", target=target)
            except (DynamoError, OSError, TimeoutError) as exc:
                self.sink.set_connection("discovery", "lost", target=target, detail=str(exc) or type(exc).__name__)
            connected = getattr(rt.events, "connected", None)
            if isinstance(connected, bool):
                if connected:
                    self.sink.set_connection("events", "ok", target=events_target)
                else:
                    self.sink.set_connection("events", "lost", target=events_target, detail="reconnecting")
            await asyncio.sleep(self.settings.probe_interval_s)

    async def _ticker(self) -> None:
        while True:
            self.sink.tick()
            await asyncio.sleep(1.0)

    async def _shutdown(self) -> None:
        if self.events is not None:
            await self.events.close()
            self.events = None
        rt, self.runtime = self.runtime, None
        if rt is not None:
            try:
                await asyncio.shield(rt.shutdown(grace_s=0.5))
            except (DynamoError, OSError) as exc:
                logger.warning("console runtime shutdown failed error=%s", exc)
