"""WorkerService of roles prefill and decode in one process (mem discovery, real request plane):
the transfer agent is published before ``generate`` is served, serves a decode, and is withdrawn."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.engines.kv_transfer import KvTransferSettings
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.daemon.worker.service import WorkerService
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol.keys import kv_transfer_key
from dynamod.shared.protocol.kv_transfer import KvLayout, decode_transfer_metadata
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, StopConditions
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.unit.mocker.factories import make_config
from tests.unit.worker.support import card_for

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4, block_size=4)


@pytest.fixture
async def runtime():
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq", lease_ttl_s=5))
    yield rt
    await rt.shutdown(1)


async def service(rt: DistributedRuntime, role: str, metrics: WorkerMetrics) -> WorkerService:
    component = rt.namespace().component("prefill" if role == "prefill" else "backend")
    lease = await rt.create_lease()
    engine = MockerEngine(make_config(num_gpu_blocks=64, speedup_ratio=1000.0), lease.id, kv_layout=LAYOUT)
    svc = WorkerService(component, engine, card_for, lease, role=role, metrics=metrics,
                        kv_transfer=KvTransferSettings(backend="tcp"))
    await svc.start()
    return svc


async def stream(rt: DistributedRuntime, component: str, instance_id: int, body: PreprocessedRequest) -> list[EngineOutput]:
    client = await rt.namespace().component(component).endpoint("generate").client()
    try:
        [inst] = [i for i in await client.wait_for_instances(1, timeout=5) if i.instance_id == instance_id]
        return [msgspec.convert(o, EngineOutput) async for o in client.stream_to(inst, msgspec.to_builtins(body))]
    finally:
        await client.close()


async def test_prefill_and_decode_services_move_kv_and_withdraw_on_stop(runtime) -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    prefill = await service(runtime, "prefill", metrics)
    decode = await service(runtime, "decode", metrics)
    key = kv_transfer_key("dynamo", "prefill", prefill.worker_id)
    meta = decode_transfer_metadata(await runtime.store.get(key))
    assert meta.worker_id == prefill.worker_id and meta.block_bytes == LAYOUT.block_bytes and meta.backend == "tcp"

    prompt = list(range(1, 23))
    outs = await stream(runtime, "prefill", prefill.worker_id, PreprocessedRequest(
        request_id="r", model="m", token_ids=prompt, prefill_only=True, stop=StopConditions(max_tokens=1)))
    params = outs[-1].disaggregated_params
    outs = await stream(runtime, "backend", decode.worker_id, PreprocessedRequest(
        request_id="r", model="m", token_ids=prompt, disaggregated_params=params,
        stop=StopConditions(max_tokens=4, ignore_eos=True)))
    report = outs[-1].disaggregated_params["kv_transfer"]
    assert report["ok"] and report["checksum"] == params["checksum"]
    wid = worker_id_hex(decode.worker_id)
    kv = metrics.kv_transfer
    assert kv.bytes.labels(wid, "pulled", "tcp")._value.get() == 6 * LAYOUT.block_bytes
    assert kv.held_blocks.labels(worker_id_hex(prefill.worker_id))._value.get() == 0

    await prefill.stop(grace_s=5)
    await decode.stop(grace_s=5)
    assert await runtime.store.get(key) is None
    assert await runtime.store.get(kv_transfer_key("dynamo", "backend", decode.worker_id)) is None
