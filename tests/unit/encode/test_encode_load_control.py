"""The encode worker's load record and control endpoints, without processes.

What a user relies on: the load record an encode worker publishes says how busy its encoder was
over the last interval (and readers built before the encode fields still decode it, while a text-only
worker's record is the map it was); a VL worker's record carries its embedding-cache
counts; ``drain`` stops new encodes and answers once the one in flight finished; ``wake`` undoes it;
``sleep`` and the other KV/adapter actions answer one clear error.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.encode.encoder import BatchStats, MockVisionEncoder
from dynamod.daemon.encode.load import EncoderLoad
from dynamod.daemon.encode.metrics import EncoderMetrics
from dynamod.daemon.encode.pages import EmbeddingPages, page_bytes
from dynamod.daemon.encode.receiver import EmbeddingReceiver
from dynamod.daemon.encode.service import EncodeService
from dynamod.shared.errors import UnavailableError
from dynamod.shared.protocol import control
from dynamod.shared.protocol.encode import EncodeReply
from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUS_READY
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata
from dynamod.shared.protocol.load import LoadMetrics, load_decoder, load_encoder
from dynamod.shared.protocol.model_card import MODEL_TYPE_ENCODE, ModelCard

HIDDEN = 8
BLOCK = page_bytes(HIDDEN)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_encoder_load_reports_busy_share_and_rate_per_interval() -> None:
    clock = _Clock()
    load = EncoderLoad(0x7, clock=clock)
    load.on_batch(BatchStats(images=2, tokens=128, seconds=0.25))
    load.on_batch(BatchStats(images=1, tokens=64, seconds=0.25))
    load.inflight_images = 3
    clock.t += 2.0
    m = load.report(STATUS_READY)
    assert (m.worker_id, m.status, m.encoder_busy, m.encode_images_per_s, m.encode_inflight_images) == (7, "ready", 0.25, 1.5, 3)
    assert m.ts > 0 and m.kv_usage == 0 and m.total_blocks == 0  # no KV figures: an encoder holds none
    clock.t += 1.0  # an idle interval reads idle, not the average since start
    idle = load.report(STATUS_DRAINING)
    assert (idle.encoder_busy, idle.encode_images_per_s, idle.status) == (0.0, 0.0, "draining")
    load.on_batch(BatchStats(images=4, tokens=256, seconds=3.0))  # a batch that began before the interval
    clock.t += 1.0
    assert load.report(STATUS_READY).encoder_busy == 1.0


class _OldLoadMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A reader built before the encode fields (the fields it knows, a subset)."""

    worker_id: int
    num_running: int = 0
    kv_usage: float = 0.0
    status: str = "ready"


def test_load_record_wire_compatibility() -> None:
    text_only = LoadMetrics(worker_id=1, num_running=2, kv_usage=0.5)
    # A text-only worker's record carries no new key: what older readers got, unchanged.
    assert msgspec.msgpack.decode(load_encoder.encode(text_only)) == {"worker_id": 1, "num_running": 2, "kv_usage": 0.5}
    enc = LoadMetrics(worker_id=2, encoder_busy=0.4, encode_images_per_s=2.0, encode_inflight_images=1,
                      embedding_cache_hits=3, embedding_cache_misses=1)
    wire = load_encoder.encode(enc)
    assert load_decoder.decode(wire) == enc
    old = msgspec.msgpack.decode(wire, type=_OldLoadMetrics)  # an old reader ignores the new fields
    assert old.worker_id == 2 and old.status == "ready"
    assert load_decoder.decode(msgspec.msgpack.encode(_OldLoadMetrics(worker_id=3))).encoder_busy == 0.0


def test_receiver_stamps_its_cache_counts_on_the_load_record() -> None:
    rx = EmbeddingReceiver(EmbeddingPages(4, BLOCK), SimpleNamespace(), worker_id=5)  # type: ignore[arg-type]
    rx.hits, rx.misses = 3, 1
    m = rx.stamp_load(LoadMetrics(worker_id=5, num_running=1))
    assert (m.embedding_cache_hits, m.embedding_cache_misses, m.num_running) == (3, 1, 1)


def _meta() -> KvTransferMetadata:
    return KvTransferMetadata(worker_id=7, backend="tcp", agent_name="x", address="127.0.0.1:1", num_blocks=64,
                              block_bytes=BLOCK)


async def _service(ms_per_image_token: float) -> tuple[EncodeService, MockVisionEncoder]:
    enc = MockVisionEncoder(EmbeddingPages(64, BLOCK), worker_id=7, hidden_size=HIDDEN, ms_per_image_token=ms_per_image_token,
                            batch_tokens=1000, hold_timeout_s=30.0, metadata=_meta)
    enc.start()
    card = ModelCard(served_model_name="m", model_types=[MODEL_TYPE_ENCODE])
    service = EncodeService(SimpleNamespace(), SimpleNamespace(id=7), card, enc, SimpleNamespace(),  # type: ignore[arg-type]
                            EncoderMetrics(CollectorRegistry()))
    return service, enc


async def _frames(handler: Any, body: Any) -> list[Any]:
    return [frame async for frame in handler(body, SimpleNamespace(headers={}))]


async def _encoding_started(service: EncodeService) -> None:
    """Until the service holds one image in flight (5 s at most)."""
    async with asyncio.timeout(5):
        while service.load.inflight_images != 1:  # noqa: ASYNC110 - no event for it: polled, briefly
            await asyncio.sleep(0.005)


GOOD = {"request_id": "r", "model": "m", "items": [{"mm_hash": "ab" * 16, "num_tokens": 64}]}


async def test_drain_waits_for_the_encode_in_flight_and_refuses_new_ones() -> None:
    service, enc = await _service(ms_per_image_token=5.0)  # 0.32 s for the image
    handlers = service._control_handlers()
    try:
        encoding = asyncio.create_task(_frames(service._encode, GOOD))
        await _encoding_started(service)
        (reply,) = await _frames(handlers[control.DRAIN], {"wait": True, "timeout_s": 10.0})
        assert encoding.done(), "drain answered before the encode in flight finished"
        (encoded,) = encoding.result()
        assert isinstance(encoded, EncodeReply)
        assert reply["status"] == control.STATUS_OK and reply["message"] == "drained"
        assert (reply["state"], reply["inflight"], service.status) == (STATUS_DRAINING, 0, STATUS_DRAINING)
        with pytest.raises(UnavailableError, match="draining"):
            await _frames(service._encode, GOOD)
        assert service.load.report(service.status).status == STATUS_DRAINING
        (woke,) = await _frames(handlers[control.WAKE_UP], None)
        assert woke["status"] == control.STATUS_OK and service.status == STATUS_READY
        (again,) = await _frames(service._encode, GOOD)
        assert isinstance(again, EncodeReply)
    finally:
        await enc.stop()


async def test_drain_timeout_is_an_error_reply() -> None:
    service, enc = await _service(ms_per_image_token=20.0)  # 1.3 s for the image
    try:
        encoding = asyncio.create_task(_frames(service._encode, GOOD))
        await _encoding_started(service)
        (reply,) = await _frames(service._control_handlers()[control.DRAIN], {"wait": True, "timeout_s": 0.05})
        assert reply["status"] == control.STATUS_ERROR and "1 requests in flight" in reply["message"]
        await encoding
    finally:
        await enc.stop()


async def test_every_control_endpoint_answers() -> None:
    service, enc = await _service(ms_per_image_token=0.0)
    try:
        handlers = service._control_handlers()
        assert set(handlers) | {control.TRACES} == set(control.CONTROL_ENDPOINTS)
        for name in (control.SLEEP, control.CLEAR_KV_BLOCKS, control.LOAD_LORA, control.UNLOAD_LORA):
            (reply,) = await _frames(handlers[name], {})
            assert reply == control.error(f"{name} is not supported on an encode worker (it holds no KV, engine or adapters)")
        (loras,) = await _frames(handlers[control.LIST_LORAS], None)
        assert loras["status"] == control.STATUS_OK and loras["loras"] == []
        (dump,) = await _frames(handlers[control.KV_DUMP], None)
        assert dump["status"] == control.STATUS_OK and dump["count"] == 0 and dump["done"]
        assert service.status == STATUS_READY  # none of them changed anything
    finally:
        await enc.stop()


class _Store:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    async def delete(self, key: str) -> None:
        self.deleted.append(key)


class _Agent:
    closed = False

    async def close(self) -> None:
        self.closed = True


async def test_stop_finishes_the_encode_in_flight_then_closes() -> None:
    """SIGTERM's path: new encodes are refused at once, the one in flight completes, then the card
    goes and the transfer agent closes."""
    enc = MockVisionEncoder(EmbeddingPages(64, BLOCK), worker_id=7, hidden_size=HIDDEN, ms_per_image_token=5.0,
                            batch_tokens=1000, hold_timeout_s=30.0, metadata=_meta)
    enc.start()
    store, agent = _Store(), _Agent()
    component = SimpleNamespace(runtime=SimpleNamespace(store=store), namespace=SimpleNamespace(name="ns"), name="encoder")
    card = ModelCard(served_model_name="m", model_types=[MODEL_TYPE_ENCODE])
    service = EncodeService(component, SimpleNamespace(id=7), card, enc, agent,  # type: ignore[arg-type]
                            EncoderMetrics(CollectorRegistry()))
    encoding = asyncio.create_task(_frames(service._encode, GOOD))
    await _encoding_started(service)
    stopping = asyncio.create_task(service.stop(grace_s=5.0))
    await asyncio.sleep(0)  # let stop mark the worker draining
    with pytest.raises(UnavailableError, match="draining"):
        await _frames(service._encode, GOOD)
    (encoded,) = await encoding
    assert isinstance(encoded, EncodeReply) and not stopping.done()  # stop waits for its held pages to be read
    for e in encoded.embeddings:  # the reader takes them (as the agg worker's notify does)
        enc.release(e.transfer_id)
    await asyncio.wait_for(stopping, 5)
    assert agent.closed and len(store.deleted) == 1 and service.status == STATUS_DRAINING
