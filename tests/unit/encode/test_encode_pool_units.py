"""The encode pool's pieces, in one process with real TCP transfer agents on loopback.

- embedding pages: an embedding written across pages reads back whole, the last page's tail is
  zero (it is checksummed), and the mocker's embedding is a function of the image's content hash;
- the encoder batches queued images under its token budget and holds each embedding until the
  reader's notification (or the hold's deadline) frees it;
- the receiver reads an embedding over the transfer layer and checks it, finds a repeated image in
  its cache (no read), evicts the least recently used image when full, and clears the params of an
  image it could not read (the engine then encodes it);
- the mocker does not charge the encoder for an image whose embedding arrived;
- the frontend's encode stage skips images the routed worker caches, retries a failed encoder once
  on another, and leaves the images to the worker when both fail.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from dynamod.daemon.encode.encoder import MockVisionEncoder
from dynamod.daemon.encode.metrics import EmbeddingCacheMetrics
from dynamod.daemon.encode.pages import EmbeddingPages, mock_embedding, page_bytes
from dynamod.daemon.encode.receiver import EmbeddingReceiver, receive_embeddings
from dynamod.daemon.frontend.pipeline.encode import EncodeStage
from dynamod.daemon.frontend.pipeline.models import EncoderPool
from dynamod.daemon.frontend.pipeline.routing import Quarantine
from dynamod.shared.errors import TransportError
from dynamod.shared.kv.transfer.factory import create_agent
from dynamod.shared.protocol.encode import EmbeddingParams, EncodeItem, EncodeReply
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.llm import MultimodalItem, PreprocessedRequest, StopConditions
from tests.unit.mocker.factories import make_core, run_to_completion

HIDDEN = 8
BLOCK = page_bytes(HIDDEN)  # 16 tokens x 8 x 2 bytes


def test_pages_round_trip_and_zero_tail() -> None:
    pages = EmbeddingPages(8, BLOCK)
    data = mock_embedding("ab" * 16, 20, HIDDEN)  # 20 tokens: one page and a quarter
    assert data == mock_embedding("ab" * 16, 20, HIDDEN) != mock_embedding("cd" * 16, 20, HIDDEN)
    ids = pages.alloc(2)
    assert ids is not None and pages.alloc(7) is None and pages.free_pages == 6
    pages.memory.array[ids[1]][:] = 0xFF  # stale bytes from an earlier embedding
    pages.write(ids, data)
    assert pages.read(ids, len(data)) == data
    assert not pages.memory.array[ids[1]][len(data) - BLOCK:].any()


async def _encoder(batch_tokens: int, hold_s: float = 30.0) -> tuple[MockVisionEncoder, list[tuple[int, int]]]:
    batches: list[tuple[int, int]] = []
    enc = MockVisionEncoder(
        EmbeddingPages(64, BLOCK), worker_id=7, hidden_size=HIDDEN, ms_per_image_token=0.01,
        batch_tokens=batch_tokens, hold_timeout_s=hold_s,
        metadata=lambda: _meta(7), on_batch=lambda s: batches.append((s.images, s.tokens)),
    )
    enc.start()
    return enc, batches


def _meta(worker_id: int):  # noqa: ANN202
    from dynamod.shared.protocol.kv_transfer import KvTransferMetadata

    return KvTransferMetadata(worker_id=worker_id, backend="tcp", agent_name="x", address="127.0.0.1:1", num_blocks=64,
                              block_bytes=BLOCK)


async def test_encoder_batches_under_token_budget_and_holds_until_released() -> None:
    enc, batches = await _encoder(batch_tokens=40)
    items = [EncodeItem(mm_hash=f"{i:032x}", num_tokens=16) for i in range(5)]
    params = await enc.encode(items)
    await enc.stop()
    assert [b for b in batches] == [(2, 32), (2, 32), (1, 16)]  # 16 + 16 fit in 40, a third does not
    assert [p.block_ids for p in params] and all(len(p.block_ids) == 1 for p in params)
    assert enc.pages.free_pages == 64 - 5 and enc.held_pages == 5
    first = params[0]
    assert enc.pages.read(first.block_ids, first.num_bytes) == mock_embedding(items[0].mm_hash, 16, HIDDEN)
    assert enc.pages.checksum(first.block_ids) == first.checksum
    assert enc.release(first.transfer_id) and not enc.release(first.transfer_id)
    assert enc.held_pages == 4


async def test_encoder_hold_expires() -> None:
    enc, _ = await _encoder(batch_tokens=100, hold_s=0.0)
    await enc.encode([EncodeItem(mm_hash="01" * 16, num_tokens=16)])
    await enc.encode([EncodeItem(mm_hash="02" * 16, num_tokens=16)])  # its batch expires the first hold
    await enc.stop()
    assert enc.held_pages <= 1


class _Pair:
    """An encode side (encoder + agent) and a receiving side (receiver + agent) on loopback."""

    async def __aenter__(self) -> _Pair:
        self.enc_pages = EmbeddingPages(64, BLOCK)
        self.enc_agent = create_agent(self.enc_pages.memory, worker_id=1, backend="tcp")
        self.encoder = MockVisionEncoder(
            self.enc_pages, worker_id=1, hidden_size=HIDDEN, ms_per_image_token=0.0, metadata=self.enc_agent.metadata,
        )
        self.enc_agent.set_notify_callback(self.encoder.release)
        await self.enc_agent.start()
        self.encoder.start()
        self.registry = CollectorRegistry()
        recv_pages = EmbeddingPages(4, BLOCK)  # room for two 32-token images
        self.receiver = EmbeddingReceiver(
            recv_pages, create_agent(recv_pages.memory, worker_id=2, backend="tcp"), worker_id=2,
            metrics=EmbeddingCacheMetrics(self.registry), read_timeout_s=2.0,
        )
        await self.receiver.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.receiver.close()
        await self.encoder.stop()
        await self.enc_agent.close()

    async def request(self, *hashes: str) -> PreprocessedRequest:
        params = await self.encoder.encode([EncodeItem(mm_hash=h, num_tokens=32) for h in hashes])
        items = [MultimodalItem(mm_hash=h, offset=40 * i, length=32, embedding=p) for i, (h, p) in enumerate(zip(hashes, params, strict=True))]
        return PreprocessedRequest(request_id="r", model="m", token_ids=[1] * 40 * len(hashes), mm_items=items)


def _sample(registry: CollectorRegistry, name: str) -> float:
    return sum(s.value for m in registry.collect() for s in m.samples if s.name == name)


async def test_receiver_reads_caches_evicts_and_frees_encoder_pages() -> None:
    async with _Pair() as p:
        a, b, c = "aa" * 16, "bb" * 16, "cc" * 16
        got = await p.receiver.receive(await p.request(a, b))
        assert all(item.embedding is not None for item in got.mm_items)
        pages = p.receiver._cache[a]
        assert p.receiver.pages.read(pages, 32 * HIDDEN * 2) == mock_embedding(a, 32, HIDDEN)
        assert await _until(lambda: p.encoder.held_pages == 0), "the reads' notifications free the encoder's pages"
        # a again: a hit (no read); its new hold on the encoder is freed by a notify.
        await p.receiver.receive(await p.request(a))
        assert (p.receiver.hits, p.receiver.misses) == (1, 2)
        assert await _until(lambda: p.encoder.held_pages == 0)
        # c needs two pages: b, the least recently used, goes.
        await p.receiver.receive(await p.request(c))
        assert p.receiver.cached(a) and p.receiver.cached(c) and not p.receiver.cached(b)
        assert _sample(p.registry, "dynamo_component_embedding_cache_hits_total") == 1
        assert _sample(p.registry, "dynamo_component_embedding_transfer_bytes_total") == 3 * 32 * HIDDEN * 2


async def test_receiver_failure_clears_params_and_decode_stage_reads_nothing() -> None:
    async with _Pair() as p:
        req = await p.request("dd" * 16)
        bad = msgspec.structs.replace(req.mm_items[0].embedding, checksum=req.mm_items[0].embedding.checksum ^ 1)
        got = await p.receiver.receive(msgspec.structs.replace(req, mm_items=[msgspec.structs.replace(req.mm_items[0], embedding=bad)]))
        assert got.mm_items[0].embedding is None and not p.receiver.cached("dd" * 16)
        assert _sample(p.registry, "dynamo_component_embedding_transfer_failures_total") == 1
        assert p.receiver.pages.free_pages == 4  # the failed read's pages went back
        gone = msgspec.structs.replace(req.mm_items[0].embedding, agent=_meta(1))  # nobody listens there
        got = await p.receiver.receive(msgspec.structs.replace(req, mm_items=[msgspec.structs.replace(req.mm_items[0], embedding=gone)]))
        assert got.mm_items[0].embedding is None
        decode = msgspec.structs.replace(await p.request("ee" * 16), disaggregated_params={"transfer_id": "t"})
        out = await receive_embeddings(p.receiver, decode)
        assert out.mm_items[0].embedding is None and p.receiver.misses == 2
        assert (await receive_embeddings(None, await p.request("ff" * 16))).mm_items[0].embedding is None


async def _until(cond, timeout: float = 3.0) -> bool:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_mocker_skips_encoding_images_whose_embedding_arrived() -> None:
    params = EmbeddingParams(transfer_id="t", worker_id=1, agent=_meta(1), block_ids=[0], num_tokens=16, hidden_size=HIDDEN)
    tokens = list(range(1, 7)) + [99] * 16 + list(range(40, 46))
    core = make_core(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=256, encode_ms_per_image_token=0.5)
    for rid, embedding in (("local", None), ("remote", params)):
        items = [MultimodalItem(mm_hash=rid * 8, offset=6, length=16, embedding=embedding)]
        core.add_preprocessed(PreprocessedRequest(request_id=rid, model="m", token_ids=tokens, stop=StopConditions(max_tokens=2), mm_items=items))
        outs = run_to_completion(core)
        assert sum(o.encode_ms for o in outs) == (8.0 if embedding is None else 0.0)


# -- the frontend's encode stage ------------------------------------------------------------------


class _Client:
    def __init__(self, replies: dict[int, object]) -> None:
        self.replies = replies
        self.calls: list[int] = []

    async def _stream(self, wid: int, body):  # noqa: ANN001, ANN202
        reply = self.replies[wid]
        if isinstance(reply, BaseException):
            raise reply
        yield reply

    def stream_to(self, instance: Instance, body, request_id=None):  # noqa: ANN001, ANN201
        self.calls.append(instance.instance_id)
        return self._stream(instance.instance_id, body)


def _stage(replies: dict[int, object]) -> tuple[EncodeStage, EncoderPool, _Client, CollectorRegistry]:
    client = _Client(replies)
    pool = EncoderPool("m")
    for wid in replies:
        inst = Instance(namespace="n", component="encoder", endpoint="encode", instance_id=wid, transport="tcp", address="x")
        pool.workers[wid] = SimpleNamespace(instances={wid: inst}, client=client)  # type: ignore[assignment]
    registry = CollectorRegistry()
    fake_registry = SimpleNamespace(encoder_pools={"m": pool}, metrics=SimpleNamespace(registry=registry))
    return EncodeStage(fake_registry, Quarantine(10.0)), pool, client, registry  # type: ignore[arg-type]


def _engine_request(n: int) -> SimpleNamespace:
    items = [MultimodalItem(mm_hash=f"{i:032x}", offset=10 + 40 * i, length=32) for i in range(n)]
    pre = PreprocessedRequest(request_id="r", model="m", token_ids=[1] * 200, mm_items=items)
    return SimpleNamespace(request_id="r", model=SimpleNamespace(name="m"), preprocessed=pre)


def _reply(n: int, wid: int) -> dict:
    return msgspec.to_builtins(EncodeReply(embeddings=[
        EmbeddingParams(transfer_id=f"t{i}", worker_id=wid, agent=_meta(wid), block_ids=[i], num_tokens=32, hidden_size=HIDDEN)
        for i in range(n)
    ]))


async def test_stage_skips_cached_images_and_retries_once() -> None:
    stage, pool, client, registry = _stage({1: TransportError("gone"), 2: _reply(1, 2)})
    pool.inflight[2] = 5  # another request's images: the least loaded, 1, is asked first
    req = _engine_request(2)
    await stage.run(req, cached_tokens=48)  # image 0 (tokens 10..41) is cached on the routed worker
    items = req.preprocessed.mm_items
    assert items[0].embedding is None and items[1].embedding is not None and items[1].embedding.worker_id == 2
    assert client.calls == [1, 2] and 1 in stage.quarantine and pool.inflight == {2: 5}  # the dead one is skipped from now on
    paths = {s.labels["path"]: s.value for m in registry.collect() for s in m.samples if s.name == "dynamo_frontend_encode_images_total"}
    assert paths == {"cached": 1.0, "remote": 1.0}


async def test_stage_falls_back_to_local_encode_after_two_failures() -> None:
    stage, _, client, registry = _stage({1: TransportError("a"), 2: TransportError("b"), 3: _reply(1, 3)})
    req = _engine_request(1)
    await stage.run(req, cached_tokens=0)
    assert len(client.calls) == 2 and req.preprocessed.mm_items[0].embedding is None
    assert _sample(registry, "dynamo_frontend_encode_images_total") == 1  # path fallback
    stage.registry.encoder_pools.clear()
    await stage.run(req, cached_tokens=0)  # no encode pool at all: the worker encodes
    assert req.preprocessed.mm_items[0].embedding is None


@pytest.mark.parametrize("n", [3])
async def test_stage_reply_of_wrong_length_is_a_failure(n: int) -> None:
    stage, pool, _, _ = _stage({1: _reply(n - 1, 1), 2: _reply(n, 2)})
    pool.inflight[2] = 1
    req = _engine_request(n)
    await stage.run(req, cached_tokens=0)
    assert all(item.embedding is not None and item.embedding.worker_id == 2 for item in req.preprocessed.mm_items)


async def test_stage_encodes_again_after_forget() -> None:
    stage, _, client, _ = _stage({1: _reply(1, 1)})
    req = _engine_request(1)
    await stage.run(req, cached_tokens=0)
    await stage.run(req, cached_tokens=0)  # params already there: nothing to encode
    assert len(client.calls) == 1
    stage.forget(req)  # a migration: the first worker's read freed them
    assert req.preprocessed.mm_items[0].embedding is None
    await stage.run(req, cached_tokens=0)
    assert len(client.calls) == 2 and req.preprocessed.mm_items[0].embedding is not None


async def test_encode_endpoint_refuses_bad_requests_and_answers_good_ones() -> None:
    from dynamod.daemon.encode.metrics import EncoderMetrics
    from dynamod.daemon.encode.service import EncodeService
    from dynamod.shared.errors import InvalidRequestError
    from dynamod.shared.protocol.model_card import MODEL_TYPE_ENCODE, ModelCard

    enc, _ = await _encoder(batch_tokens=100)
    registry = CollectorRegistry()
    card = ModelCard(served_model_name="m", model_types=[MODEL_TYPE_ENCODE])
    service = EncodeService(SimpleNamespace(), SimpleNamespace(id=7), card, enc, SimpleNamespace(), EncoderMetrics(registry))  # type: ignore[arg-type]

    async def call(body: dict) -> list:
        return [frame async for frame in service._encode(body, SimpleNamespace(headers={}))]  # type: ignore[arg-type]

    good = {"request_id": "r", "model": "m", "items": [{"mm_hash": "ab" * 16, "num_tokens": 16}]}
    for bad, why in (({**good, "model": "other"}, "serves 'm'"), ({**good, "items": []}, "at least one"),
                     ({**good, "items": [{"mm_hash": "x", "num_tokens": 10**9}]}, "num_tokens must be"),
                     ({"request_id": "r"}, "bad encode request")):
        with pytest.raises(InvalidRequestError, match=why):
            await call(bad)
    (reply,) = await call(good)
    await enc.stop()
    assert isinstance(reply, EncodeReply) and reply.embeddings[0].num_tokens == 16
    assert _sample(registry, "dynamo_component_encoder_images_total") == 1
    assert _sample(registry, "dynamo_component_encoder_requests_total") == 1
    assert _sample(registry, "dynamo_component_encoder_inflight_images") == 0
