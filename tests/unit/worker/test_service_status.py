"""The worker service's status reaches discovery even when the store misses a write (a repair found
in review: the test fails without it). The same for a served endpoint alone:
tests/unit/runtime/test_deferred_status.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.daemon.worker.service import WorkerService
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.discovery_faults import FlakyStore
from tests.unit.mocker.factories import make_config
from tests.unit.runtime.support import stored_instance, until
from tests.unit.worker.support import card_for


async def test_worker_sleep_during_a_failed_write_reaches_discovery_when_it_answers() -> None:
    store = FlakyStore()
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq"), store=store)
    lease = await rt.create_lease()
    engine = MockerEngine(make_config(num_gpu_blocks=64, speedup_ratio=1000.0), lease.id)
    svc = WorkerService(
        rt.namespace().component("backend"), engine, card_for, lease, role="", metrics=WorkerMetrics(CollectorRegistry())
    )
    await svc.start()
    try:
        generate = next(s for s in svc._served if s.record.endpoint == "generate")
        store.fail_prefix, store.failures_left = generate.key, 1
        replies = [x async for x in svc._sleep({"level": 1}, None)]
        # The worker sleeps at once; discovery gets the status when it takes the write again.
        assert svc.status == "sleeping" and replies[-1]["state"] == "sleeping"
        await until(lambda: not generate.write_pending, timeout=10)
        assert (await stored_instance(store, generate)).status == "sleeping"
        assert all(s.record.status == "sleeping" for s in svc._served)
    finally:
        await svc.stop(grace_s=0)
        await rt.shutdown(0)
