"""Operator intent: the wire struct, the recorder that writes it, the listing tools, and the
worker names it is kept under."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.engines.base import LoraInfo
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.worker.lora_policy import LoraSourcePolicy
from dynamod.daemon.worker.main import worker_names
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.daemon.worker.service import WorkerService
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.file import FileStore
from dynamod.shared.errors import ConfigError, NotFoundError, UnavailableError
from dynamod.shared.protocol.instance import decode_instance
from dynamod.shared.protocol.intent import WorkerIntent, decode_intent, encode_intent
from dynamod.shared.protocol.keys import instances_prefix, intent_key, mdc_key
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.runtime.intent import IntentRecorder, clear_intent, list_intents
from tests.fixtures.discovery_faults import FlakyStore
from tests.fixtures.lora import make_adapter
from tests.unit.mocker.factories import make_config
from tests.unit.runtime.support import until
from tests.unit.worker.support import card_for

KEY = intent_key("ns", "backend", "decode-0")
ADAPTERS: dict[str, str] = {}  # adapter name -> its resolved directory under this test's --lora-root


@pytest.fixture(autouse=True)
def lora_root(tmp_path):
    """A --lora-root holding adapter ``sql``; ``gone://`` sources pass the check (the engine refuses them)."""
    root = tmp_path / "adapters"
    ADAPTERS["sql"] = str(make_adapter(root, "sql").resolve())
    ADAPTERS["root"] = str(root)
    yield
    ADAPTERS.clear()


@pytest.fixture
async def store():
    s = FlakyStore()
    await s.start()
    yield s
    await s.close()


# -- the struct ------------------------------------------------------------------------------------


def test_intent_round_trips_as_json_and_ignores_unknown_fields() -> None:
    intent = WorkerIntent(status="sleeping", sleep_level=2, loras={"sql": "file:///a/sql"}, ts=1.5, set_by="sleep")
    raw = encode_intent(intent)
    assert msgspec.json.decode(raw)["loras"] == {"sql": "file:///a/sql"}
    assert decode_intent(raw) == intent
    newer = msgspec.json.encode({**msgspec.to_builtins(intent), "added_later": True})
    assert decode_intent(newer) == intent


@pytest.mark.parametrize(
    "value",
    [
        {"status": "asleep"},
        {"status": "sleeping"},  # no level
        {"status": "sleeping", "sleep_level": 3},
        {"status": "draining", "sleep_level": 1},
        {"status": "ready", "loras": {"a/b": "x"}},
        {"loras": ["not", "a", "map"]},
    ],
)
def test_invalid_intent_is_refused_whole(value: dict) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_intent(msgspec.json.encode(value))


def test_empty_means_nothing_to_reapply() -> None:
    assert WorkerIntent().empty
    assert not WorkerIntent(status="draining").empty
    assert not WorkerIntent(loras={"a": "s"}).empty
    assert WorkerIntent(status="draining", ts=1).same_as(WorkerIntent(status="draining", ts=2, set_by="x"))


# -- the recorder ----------------------------------------------------------------------------------


async def test_recorder_writes_without_lease_and_deletes_when_nothing_is_left(store: FlakyStore) -> None:
    rec = IntentRecorder(store, "ns", "backend", "decode-0")
    assert (await rec.load()).empty
    await rec.set_status("sleeping", 2, set_by="sleep")
    await rec.add_lora("sql", "file:///a/sql", set_by="load_lora")
    stored = decode_intent(await store.get(KEY))
    assert (stored.status, stored.sleep_level, stored.loras, stored.set_by) == ("sleeping", 2, {"sql": "file:///a/sql"}, "load_lora")
    assert stored.ts > 0
    assert KEY not in store._key_lease  # not under any lease: it outlives the process

    await rec.set_status("ready", set_by="wake_up")
    assert decode_intent(await store.get(KEY)) == msgspec.structs.replace(stored, status="ready", sleep_level=0,
                                                                        ts=rec.current.ts, set_by="wake_up")
    await rec.remove_loras(["sql"], set_by="unload_lora")
    assert await store.get(KEY) is None  # wake + unload cleared it all

    again = IntentRecorder(store, "ns", "backend", "decode-0")
    assert (await again.load()).empty


async def test_recorder_retries_a_failed_write_until_it_lands(store: FlakyStore) -> None:
    rec = IntentRecorder(store, "ns", "backend", "decode-0")
    await rec.load()
    store.failures_left = 10**6  # discovery away
    assert await rec.set_status("draining", set_by="drain") is False
    assert rec.pending and rec.current.draining and await store.get(KEY) is None
    store.failures_left = 0  # back
    await until(lambda: not rec.pending, timeout=10)
    assert decode_intent(await store.get(KEY)).draining
    await rec.close()


async def test_recorder_skips_writes_that_change_nothing(store: FlakyStore) -> None:
    rec = IntentRecorder(store, "ns", "backend", "decode-0")
    await rec.load()
    await rec.set_status("ready", set_by="wake_up")  # nothing stored, nothing to delete
    await rec.set_status("draining", set_by="drain")
    store.failures_left = 1  # a write now would fail: proves none is attempted
    await rec.set_status("draining", set_by="drain")
    assert store.failures_left == 1


async def test_unreadable_intent_is_ignored_at_load(store: FlakyStore) -> None:
    await store.put(KEY, b'{"status": "asleep"}')
    rec = IntentRecorder(store, "ns", "backend", "decode-0")
    assert (await rec.load()).empty
    await rec.set_status("draining", set_by="drain")  # replaces the bad value
    assert decode_intent(await store.get(KEY)).draining


def test_recorder_refuses_a_worker_name_that_is_not_a_key_segment(store: FlakyStore) -> None:
    with pytest.raises(Exception, match="worker name"):
        IntentRecorder(store, "ns", "backend", "a/b")


async def test_list_and_clear_intents(store: FlakyStore) -> None:
    await IntentRecorder(store, "ns", "backend", "w1").set_status("draining", set_by="drain")
    await IntentRecorder(store, "ns", "prefill", "p0").add_lora("sql", "s", set_by="load_lora")
    await IntentRecorder(store, "other", "backend", "w1").set_status("sleeping", 1, set_by="sleep")
    await store.put(intent_key("ns", "backend", "bad"), b"not json")
    await store.put("v1/intent/ns/too/many/parts", b"{}")
    listed = await list_intents(store, "ns")
    assert [(i.component, i.worker_name) for i in listed] == [("backend", "bad"), ("backend", "w1"), ("prefill", "p0")]
    assert listed[0].intent is None and listed[0].error
    assert listed[1].intent is not None and listed[1].intent.draining
    assert len(await list_intents(store)) == 4
    assert await clear_intent(store, "ns", "backend", "w1")
    assert not await clear_intent(store, "ns", "backend", "w1")
    assert [i.worker_name for i in await list_intents(store, "ns")] == ["bad", "p0"]


async def test_file_discovery_keeps_intent_when_its_writer_is_gone(tmp_path) -> None:
    """A worker's leased records go with it; the intent (no lease) stays for its next run."""
    writer, reader = FileStore(str(tmp_path)), FileStore(str(tmp_path))
    await writer.start()
    await reader.start()
    try:
        lease = await writer.create_lease(2.0)
        await writer.put("v1/instances/ns/backend/generate/1", b"{}", lease)
        await IntentRecorder(writer, "ns", "backend", "w").set_status("draining", set_by="drain")
        await writer.close()  # revokes the lease: its keys go
        found = await reader.get_prefix("v1/")
        assert list(found) == [intent_key("ns", "backend", "w")]
        assert decode_intent(found[intent_key("ns", "backend", "w")]).draining
    finally:
        await reader.close()


# -- worker names ----------------------------------------------------------------------------------


def test_worker_names() -> None:
    assert worker_names("decode-0", "node", None, 1) == ["decode-0"]
    assert worker_names("w", "node", 9000, 3) == ["w-0", "w-1", "w-2"]
    assert worker_names(None, "gpu7", 9000, 1) == ["gpu7-9000"]  # a fixed status port names the process
    assert worker_names(None, "gpu7", 9000, 2) == ["gpu7-9000-0", "gpu7-9000-1"]
    assert worker_names(None, "gpu7", 0, 2) == [None, None]  # an ephemeral port is not stable
    assert worker_names(None, "gpu7", None, 1) == [None]
    for bad in ("", "a/b"):
        with pytest.raises(ConfigError):
            worker_names(bad, "node", None, 1)


# -- the worker service: restore before serving, record after acting -------------------------------


class PickyMocker(MockerEngine):
    """A mocker that cannot load adapters from ``gone://`` sources (their files were deleted) and,
    when told, has no sleep mode: the failures a restart must survive."""

    can_sleep = True

    async def load_lora(self, name: str, source: str) -> LoraInfo:
        if source.startswith("gone://"):
            raise NotFoundError(f"LoRA source {source} does not exist")
        return await super().load_lora(name, source)

    async def sleep(self, level: int) -> None:
        if not self.can_sleep:
            raise UnavailableError("this engine has no sleep mode")
        await super().sleep(level)


@pytest.fixture
async def runtime(store: FlakyStore):
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq", namespace="ns"), store=store)
    yield rt
    await rt.shutdown(0)


async def _worker(rt: DistributedRuntime, name: str | None = "decode-0", *, can_sleep: bool = True) -> WorkerService:
    lease = await rt.create_lease()
    engine = PickyMocker(make_config(num_gpu_blocks=64, speedup_ratio=1000.0), lease.id)
    engine.can_sleep = can_sleep
    component = rt.namespace().component("backend")
    intent = IntentRecorder(rt.store, "ns", "backend", name) if name else None
    policy = LoraSourcePolicy.create([ADAPTERS["root"]], ["gone"])
    svc = WorkerService(component, engine, card_for, lease, role="decode", metrics=WorkerMetrics(CollectorRegistry()), intent=intent,
                        lora_policy=policy)
    await svc.start()
    return svc


async def _call(handler, body: dict | None = None) -> dict:
    return [x async for x in handler(body or {}, None)][-1]


@contextlib.asynccontextmanager
async def _worker_in_outage(rt: DistributedRuntime, store: FlakyStore) -> AsyncIterator[WorkerService]:
    """A started worker whose intent writes discovery refuses until ``_intent_lands``; stopped on exit."""
    svc = await _worker(rt)
    try:
        store.fail_prefix, store.failures_left = KEY, 10**6
        yield svc
    finally:
        await svc.stop(grace_s=0)


async def _intent_lands(store: FlakyStore, svc: WorkerService) -> WorkerIntent:
    """Discovery answers again: waits for the worker's pending intent write to land; returns what is stored."""
    store.failures_left = 0
    await until(lambda: svc._intent is not None and not svc._intent.pending, timeout=10)
    return decode_intent(await store.get(KEY))


async def _started_seeing(rt: DistributedRuntime, start) -> tuple[WorkerService, list[str]]:
    """Starts a worker while watching every instance record it writes; returns the statuses seen.
    The watch is proven live (it saw a marker key) before the worker starts, so no write is missed."""
    marker = instances_prefix("ns") + "marker"
    subscribed = asyncio.Event()
    records: asyncio.Queue[str] = asyncio.Queue(maxsize=100)

    async def collect() -> None:
        async for ev in rt.store.watch_prefix(instances_prefix("ns")):
            if ev.key == marker:
                subscribed.set()
            elif ev.value is not None:
                records.put_nowait(decode_instance(ev.value).status)

    task = asyncio.create_task(collect())
    try:
        await rt.store.put(marker, b"{}")
        async with asyncio.timeout(5):
            await subscribed.wait()
        svc = await start()
        async with asyncio.timeout(5):
            seen = [await records.get() for _ in svc._served]
        seen += [records.get_nowait() for _ in range(records.qsize())]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await rt.store.delete(marker)
    return svc, seen


async def test_restart_reapplies_sleep_level_and_adapters_before_serving(runtime: DistributedRuntime) -> None:
    first = await _worker(runtime)
    assert (await _call(first._load_lora, {"lora_name": "sql", "source": "file://" + ADAPTERS["sql"]}))["status"] == "ok"
    assert (await _call(first._sleep, {"level": 2}))["state"] == "sleeping"
    await first.stop(grace_s=0)

    second, seen = await _started_seeing(runtime, lambda: _worker(runtime))
    try:
        assert seen and set(seen) == {"sleeping"}  # never ready in between
        assert second.status == "sleeping" and second.engine.sleep_level == 2
        assert [lo.name for lo in second.engine.list_loras()] == ["sql"]
        assert await runtime.store.get(mdc_key("ns", "backend", "generate", second.worker_id, "sql")) is not None
        assert all(s.record.labels["worker_name"] == "decode-0" for s in second._served)
        # wake_up clears the sleep, unload_lora the adapter: nothing is left to re-apply.
        assert (await _call(second._wake_up))["state"] == "ready"
        assert (await _call(second._unload_lora, {"lora_name": "sql"}))["status"] == "ok"
        assert await runtime.store.get(KEY) is None
    finally:
        await second.stop(grace_s=0)


async def test_restart_drops_an_adapter_whose_source_is_gone_and_keeps_draining(runtime: DistributedRuntime) -> None:
    await runtime.store.put(KEY, encode_intent(WorkerIntent(status="draining", loras={"old": "gone://old", "sql": ADAPTERS["sql"], "etc": "/etc"})))
    svc, seen = await _started_seeing(runtime, lambda: _worker(runtime))
    try:
        assert set(seen) == {"draining"}
        assert [lo.name for lo in svc.engine.list_loras()] == ["sql"]
        stored = decode_intent(await runtime.store.get(KEY))
        # The engine's refusal and the policy's (outside --lora-root) both drop the adapter.
        assert stored.loras == {"sql": ADAPTERS["sql"]} and stored.draining and stored.set_by == "restart"
    finally:
        await svc.stop(grace_s=0)


async def test_a_sleep_the_engine_refuses_at_restart_registers_draining(runtime: DistributedRuntime) -> None:
    await runtime.store.put(KEY, encode_intent(WorkerIntent(status="sleeping", sleep_level=1)))
    svc, seen = await _started_seeing(runtime, lambda: _worker(runtime, can_sleep=False))
    try:
        assert set(seen) == {"draining"}  # takes no work, as the operator wanted
        assert decode_intent(await runtime.store.get(KEY)).sleeping  # kept for the operator to decide
    finally:
        await svc.stop(grace_s=0)


async def test_an_intent_write_discovery_refuses_is_reported_pending_and_lands_later(
    runtime: DistributedRuntime, store: FlakyStore
) -> None:
    async with _worker_in_outage(runtime, store) as svc:  # the instance records take the drain; the intent waits
        reply = await _call(svc._drain, {"wait": False})
        assert reply["status"] == "ok" and reply["discovery_pending"] is True and "not answering" in reply["message"]
        assert reply["state"] == "draining" and svc.status == "draining"  # the drain itself stands
        assert await store.get(KEY) is None
        assert (await _intent_lands(store, svc)).draining

        assert (await _call(svc._load_lora, {"lora_name": "sql", "source": ADAPTERS["sql"]}))["status"] == "ok"
        store.failures_left = 1  # one failed write: the retry lands within the reply's wait
        reply = await _call(svc._unload_lora, {"lora_name": "sql"})
        assert reply["status"] == "ok" and "discovery_pending" not in reply
        assert svc.engine.list_loras() == [] and decode_intent(await store.get(KEY)).loras == {}
        with pytest.raises(NotFoundError):
            await _call(svc._unload_lora, {"lora_name": "sql"})


async def test_sleep_during_an_outage_saves_the_level_when_discovery_answers(
    runtime: DistributedRuntime, store: FlakyStore
) -> None:
    async with _worker_in_outage(runtime, store) as svc:
        assert (await _call(svc._sleep, {"level": 2}))["discovery_pending"] is True
        assert svc.status == "sleeping"
        stored = await _intent_lands(store, svc)
        assert stored.sleeping and stored.sleep_level == 2


async def test_clear_kv_and_unnamed_workers_keep_no_intent(runtime: DistributedRuntime) -> None:
    named = await _worker(runtime)
    unnamed = await _worker(runtime, None)
    try:
        assert (await _call(named._clear_kv_blocks))["status"] == "ok"
        assert (await _call(unnamed._drain, {"wait": False}))["status"] == "ok"
        assert await runtime.store.get_prefix("v1/intent/") == {}
        assert "worker_name" not in unnamed._served[0].record.labels
    finally:
        await named.stop(grace_s=0)
        await unnamed.stop(grace_s=0)
