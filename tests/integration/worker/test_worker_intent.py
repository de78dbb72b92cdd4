"""Operator intent outlives a worker's process: a drained, sleeping or LoRA-carrying worker that is
killed (-9) and started again under the same worker name comes back the way the operator left it,
and is never ``ready`` in between; ``wake_up`` and ``unload_lora`` clear the intent.

Real etcd, real ``dynamod --role agg --engine mocker`` processes, control calls through the same
client ``dynamoctl`` uses; and once through ``dynamod up`` (file discovery), where the supervisor
restarts the killed worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from dynamod.console.actions.control import ControlClient
from dynamod.console.actions.specs import ACTIONS_BY_NAME as ACT
from dynamod.console.actions.specs import LIST_LORAS
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol import control
from dynamod.shared.protocol.instance import decode_instance
from dynamod.shared.protocol.intent import decode_intent
from dynamod.shared.protocol.keys import instances_prefix, intent_key, mdc_key
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.daemons import DaemonProcess, Up, up_command
from tests.fixtures.lora import make_adapter
from tests.fixtures.servers import EtcdServer, free_port
from tests.integration.frontend.test_frontend_support import clean_env

pytestmark = pytest.mark.timeout(240)

NS, COMPONENT = "dynamo", "backend"
TTL = 2.0
ENDPOINTS = 1 + len(control.CONTROL_ENDPOINTS)  # generate and the control endpoints


class InstanceLog:
    """Every instance record written under ``v1/instances/{ns}/backend/``, in order, from a watch
    proven live (it saw a marker key) before anything the test does next."""

    def __init__(self, store: DiscoveryStore) -> None:
        self._store = store
        self._prefix = instances_prefix(NS, COMPONENT)
        self._marker = self._prefix + "marker"
        self.records: list[tuple[int, str, str]] = []  # (instance id, endpoint, status)
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> InstanceLog:
        subscribed = asyncio.Event()

        async def collect() -> None:
            async for ev in self._store.watch_prefix(self._prefix):
                if ev.key == self._marker:
                    subscribed.set()
                elif ev.value is not None:
                    inst = decode_instance(ev.value)
                    self.records.append((inst.instance_id, inst.endpoint, inst.status))
                    self._changed.set()

        self._task = asyncio.create_task(collect())
        await self._store.put(self._marker, b"{}")
        async with asyncio.timeout(10):
            await subscribed.wait()
        await self._store.delete(self._marker)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def registered(self, daemon_alive, known: set[int], timeout: float = 60.0) -> tuple[int, set[str]]:
        """The first instance not in ``known`` once all its endpoints are in discovery, with every
        status any of its records ever had."""
        async with asyncio.timeout(timeout):
            while True:
                self._changed.clear()
                ids = {iid for iid, _, _ in self.records if iid not in known}
                for iid in ids:
                    mine = [(ep, st) for i, ep, st in self.records if i == iid]
                    if len({ep for ep, _ in mine}) == ENDPOINTS:
                        return iid, {st for _, st in mine}
                assert daemon_alive(), "the worker exited before registering"
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):  # wakes to re-check the process, not to sync
                        await self._changed.wait()


class EtcdWorkers:
    """Worker processes on one etcd, and an in-test runtime to watch and control them."""

    def __init__(self, etcd: EtcdServer, rt: DistributedRuntime, log_dir: Path) -> None:
        self.rt = rt
        self.ctl = ControlClient(rt, namespace=NS)
        self.log_dir = log_dir
        self.env = {
            **os.environ, "DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd.endpoint,
            "DYN_EVENT_PLANE": "zmq", "DYN_LEASE_TTL": str(TTL), "DYN_LORA_ROOT": str(log_dir / "adapters"),
        }
        (log_dir / "adapters").mkdir(exist_ok=True)
        self.daemons: list[DaemonProcess] = []
        self.known: set[int] = set()

    def start(self, worker_name: str) -> DaemonProcess:
        daemon = DaemonProcess(
            ["--role", "agg", "--engine", "mocker", "--model", "tiny", "--speedup-ratio", "20",
             "--worker-name", worker_name],
            env=self.env, log_dir=str(self.log_dir),
        )
        self.daemons.append(daemon)
        return daemon

    async def registered(self, log: InstanceLog, daemon: DaemonProcess) -> tuple[int, set[str]]:
        try:
            iid, statuses = await log.registered(daemon.alive, self.known)
        except (TimeoutError, AssertionError) as exc:
            raise AssertionError(f"{exc!r}; worker log:\n{daemon.log()}") from None
        self.known.add(iid)
        return iid, statuses

    async def restart(self, log: InstanceLog, daemon: DaemonProcess, worker_name: str) -> tuple[DaemonProcess, int, set[str]]:
        daemon.kill()  # SIGKILL: nothing is cleaned up, the old records wait for their lease
        again = self.start(worker_name)
        iid, statuses = await self.registered(log, again)
        return again, iid, statuses

    async def intent(self, worker_name: str):
        raw = await self.rt.store.get(intent_key(NS, COMPONENT, worker_name))
        return None if raw is None else decode_intent(raw)


@pytest.fixture
async def workers(etcd_server: EtcdServer, tmp_path: Path):
    settings = RuntimeSettings(discovery_backend="etcd", etcd_endpoints=[etcd_server.endpoint], event_plane="zmq", lease_ttl_s=TTL)
    rt = await DistributedRuntime.create(settings, events=False)
    harness = EtcdWorkers(etcd_server, rt, tmp_path)
    try:
        yield harness
    finally:
        for daemon in harness.daemons:
            daemon.kill()
        await harness.ctl.close()
        await rt.shutdown(0)


async def test_a_drained_worker_comes_back_draining_until_woken(workers: EtcdWorkers) -> None:
    async with InstanceLog(workers.rt.store) as log:
        daemon = workers.start("w0")
        first, statuses = await workers.registered(log, daemon)
        assert statuses == {"ready"}
        assert (await workers.ctl.run(ACT["drain"], first, control.DrainRequest(wait=False))).ok
        assert (await workers.intent("w0")).draining

        daemon, second, statuses = await workers.restart(log, daemon, "w0")
        assert statuses == {"draining"}, "the restarted worker was ready before it was draining"

        woke = await workers.ctl.run(ACT["wake"], second, control.EmptyRequest())
        assert woke.ok and woke.data["state"] == "ready"
        assert await workers.intent("w0") is None  # wake_up cleared it

        daemon, _, statuses = await workers.restart(log, daemon, "w0")
        assert statuses == {"ready"}


async def test_a_sleeping_worker_comes_back_asleep_at_its_level(workers: EtcdWorkers) -> None:
    async with InstanceLog(workers.rt.store) as log:
        daemon = workers.start("w0")
        first, _ = await workers.registered(log, daemon)
        assert (await workers.ctl.run(ACT["sleep"], first, control.SleepRequest(level=2))).ok
        stored = await workers.intent("w0")
        assert stored.sleeping and stored.sleep_level == 2

        daemon, second, statuses = await workers.restart(log, daemon, "w0")
        assert statuses == {"sleeping"}
        again = await workers.ctl.run(ACT["sleep"], second, control.SleepRequest(level=1))
        assert again.ok and again.message == "already sleeping" and again.data["level"] == 2

        assert (await workers.ctl.run(ACT["wake"], second, control.EmptyRequest())).ok
        assert await workers.intent("w0") is None


async def test_a_loaded_lora_adapter_is_loaded_again_until_unloaded(workers: EtcdWorkers) -> None:
    async with InstanceLog(workers.rt.store) as log:
        daemon = workers.start("w0")
        first, _ = await workers.registered(log, daemon)
        # Recorded as the checked, resolved directory inside --lora-root, not as given.
        pirate = str(make_adapter(workers.log_dir / "adapters", "pirate").resolve())
        assert (await workers.ctl.run(ACT["load_lora"], first, control.LoadLoraRequest(lora_name="pirate", source=control.LoraSource(uri=f"file://{pirate}")))).ok
        assert (await workers.intent("w0")).loras == {"pirate": pirate}

        daemon, second, statuses = await workers.restart(log, daemon, "w0")
        assert statuses == {"ready"}
        listed = await workers.ctl.run(LIST_LORAS, second, control.EmptyRequest())
        assert [(lo["name"], lo["source"]) for lo in listed.data["loras"]] == [("pirate", pirate)]
        # Its model card was published with the worker, so frontends serve the adapter again.
        assert await workers.rt.store.get(mdc_key(NS, COMPONENT, "generate", second, "pirate")) is not None

        assert (await workers.ctl.run(ACT["unload_lora"], second, control.UnloadLoraRequest(lora_name="pirate"))).ok
        assert await workers.intent("w0") is None

        _, third, _ = await workers.restart(log, daemon, "w0")
        assert (await workers.ctl.run(LIST_LORAS, third, control.EmptyRequest())).data["loras"] == []


async def test_up_restarts_a_killed_drained_worker_still_draining(tmp_path: Path) -> None:
    """`dynamod up` names each worker after its child (worker-0); the supervisor's restart of a
    killed worker finds the intent in file discovery (no lease: the reader-side collection of the
    dead worker's records leaves it) and the worker registers draining."""
    port = free_port()
    file_kv = tmp_path / "discovery"
    up = Up(
        up_command("--http-port", str(port), "--workers", "1", "--speedup-ratio", "10", "--file-kv", str(file_kv),
                    "--log-dir", str(tmp_path / "logs")),
        clean_env(file_kv), cwd=tmp_path,
    )
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(file_kv), event_plane="zmq")
    rt = None
    try:
        await asyncio.to_thread(up.wait_up)
        rt = await DistributedRuntime.create(settings, events=False)
        ctl = ControlClient(rt, namespace=NS)
        try:
            async with InstanceLog(rt.store) as log:
                alive = lambda: up.proc.poll() is None  # noqa: E731
                first, statuses = await log.registered(alive, set())
                assert statuses == {"ready"}
                assert (await ctl.run(ACT["drain"], first, control.DrainRequest(wait=False))).ok
                stored = decode_intent(await rt.store.get(intent_key(NS, COMPONENT, "worker-0")))
                assert stored.draining
                [pid] = {r.pid for r in await ctl.instances() if r.instance_id == first}
                os.kill(pid, signal.SIGKILL)

                second, statuses = await log.registered(alive, {first})
                assert statuses == {"draining"}, up.output
                assert "worker-0 died" in up.output  # the supervisor restarted it, not someone else
        finally:
            await ctl.close()
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.kill()
        if rt is not None:
            await rt.shutdown(0)
