"""``/v1/embeddings`` through the real frontend (HTTP server, model registry, request plane) in front
of in-process workers serving ``embed`` with the mocker's embedding engine, driven by the official
client: inputs of every kind, both encodings, ``dimensions``, model-type mismatches, fail-over."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import numpy as np
import openai
import pytest

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.embedding import MockerEmbeddingEngine, deterministic_embedding
from dynamod.daemon.frontend.preprocess import Tokenizer
from dynamod.daemon.models import TINY_MODEL_DIR
from dynamod.shared.errors import UnavailableError
from dynamod.shared.protocol.embedding import EMBED_ENDPOINT, EmbedRequest
from dynamod.shared.protocol.keys import mdc_key
from dynamod.shared.protocol.model_card import MODEL_TYPE_EMBEDDING, EmbeddingSpec, ModelCard, encode_card
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.test_app import Cluster, client

DIMS = 32
CONTEXT = 64


@dataclass
class Embedder:
    engine: MockerEmbeddingEngine
    lease: Any
    fail: bool = False  # answer UnavailableError (a draining worker)
    requests: list[dict] = field(default_factory=list)

    @property
    def id(self) -> int:
        return self.lease.id

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        self.requests.append(body)
        if self.fail:
            raise UnavailableError("worker draining (test)")
        yield await self.engine.embed(msgspec.convert(body, EmbedRequest))


class EmbeddingCluster(Cluster):
    def __init__(self) -> None:
        super().__init__()
        self.embedders: list[Embedder] = []

    async def add_embedder(self, model: str = "tiny-embed", *, matryoshka: bool = True, fail: bool = False) -> Embedder:
        assert self.rt is not None and self.state is not None
        lease = await self.rt.create_lease()
        config = MockerConfig(num_gpu_blocks=64, block_size=16, vocab_size=Tokenizer.from_dir(TINY_MODEL_DIR).vocab_size,
                              speedup_ratio=100.0)
        engine = MockerEmbeddingEngine(config, lease.id, dimensions=DIMS)
        await engine.start()
        embedder = Embedder(engine, lease, fail=fail)
        card = ModelCard(
            served_model_name=model, model_types=[MODEL_TYPE_EMBEDDING], tokenizer_source=str(TINY_MODEL_DIR),
            context_length=CONTEXT, embedding=EmbeddingSpec(dimensions=DIMS, matryoshka=matryoshka),
        )
        await self.store.put(mdc_key("dynamo", "backend", EMBED_ENDPOINT, lease.id), encode_card(card), lease)
        await self.rt.namespace().component("backend").endpoint(EMBED_ENDPOINT).serve(embedder.handler, lease=lease, model=model)
        self.embedders.append(embedder)
        registry = self.state.registry

        def ready() -> bool:
            m = registry.embedding_models.get(model)
            return m is not None and any(i.instance_id == lease.id for i in m.candidates(self.state.dispatcher.quarantine))

        await self.wait(ready)
        return embedder

    async def stop(self) -> None:
        for e in self.embedders:
            await e.engine.stop()
        await super().stop()


@pytest.fixture
async def cluster() -> AsyncIterator[EmbeddingCluster]:
    c = EmbeddingCluster()
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def _tokens(text: str) -> list[int]:
    return Tokenizer.from_dir(TINY_MODEL_DIR).encode(text, add_special_tokens=True)


async def test_every_input_kind_and_both_encodings(cluster: EmbeddingCluster) -> None:
    await cluster.add_embedder()
    api = client(cluster)
    text = "the quick brown fox"
    ids = _tokens(text)
    expected = deterministic_embedding(ids, DIMS)

    default = await api.embeddings.create(model="tiny-embed", input=text)  # the client asks for base64 and decodes it
    assert np.array_equal(np.asarray(default.data[0].embedding, dtype=np.float32), expected)
    assert default.usage.prompt_tokens == default.usage.total_tokens == len(ids) and default.model == "tiny-embed"

    floats = await api.embeddings.create(model="tiny-embed", input=[text, "jumps over"], encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    assert np.array_equal(np.asarray(floats.data[0].embedding, dtype=np.float32), expected)
    assert np.array_equal(np.asarray(floats.data[1].embedding, dtype=np.float32),
                          deterministic_embedding(_tokens("jumps over"), DIMS))
    assert floats.usage.prompt_tokens == len(ids) + len(_tokens("jumps over"))

    by_ids = await api.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    assert np.array_equal(np.asarray(by_ids.data[0].embedding, dtype=np.float32), expected)
    batch = await api.embeddings.create(model="tiny-embed", input=[ids, [7, 8, 9]], encoding_format="float")
    assert len(batch.data) == 2 and len(batch.data[1].embedding) == DIMS

    # The raw base64 is the float32 little-endian bytes, as OpenAI sends them.
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        resp = await raw.post("/v1/embeddings", json={"model": "tiny-embed", "input": text, "encoding_format": "base64"})
    assert resp.status_code == 200
    assert base64.b64decode(resp.json()["data"][0]["embedding"]) == expected.tobytes()
    assert resp.headers["x-dynamo-worker-instance-id"] == worker_id_hex(cluster.embedders[0].id)


async def test_dimensions(cluster: EmbeddingCluster) -> None:
    await cluster.add_embedder()
    await cluster.add_embedder("fixed-embed", matryoshka=False)
    api = client(cluster)
    ids = _tokens("matryoshka dolls")
    short = await api.embeddings.create(model="tiny-embed", input=ids, dimensions=8, encoding_format="float")
    full = deterministic_embedding(ids, DIMS).astype(np.float64)
    assert np.allclose(short.data[0].embedding, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    assert len((await api.embeddings.create(model="fixed-embed", input=ids, dimensions=DIMS)).data[0].embedding) == DIMS
    for model, dims in (("tiny-embed", DIMS + 1), ("fixed-embed", 8)):
        with pytest.raises(openai.BadRequestError) as info:
            await api.embeddings.create(model=model, input="x", dimensions=dims)
        assert info.value.body["param"] == "dimensions"
    assert [len(e.requests) for e in cluster.embedders] == [1, 1]  # the refused ones never left the frontend


async def test_model_kinds_do_not_mix(cluster: EmbeddingCluster) -> None:
    await cluster.add_worker()  # the chat model "tiny"
    await cluster.add_embedder()
    api = client(cluster)
    assert sorted(m.id for m in (await api.models.list()).data) == ["tiny", "tiny-embed"]
    assert (await api.models.retrieve("tiny-embed")).id == "tiny-embed"
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        await api.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        await api.completions.create(model="tiny-embed", prompt="x")
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
        await api.embeddings.create(model="tiny", input="x")
    with pytest.raises(openai.NotFoundError):
        await api.embeddings.create(model="nope", input="x")
    async with httpx.AsyncClient(base_url=cluster.url) as raw:
        health = (await raw.get("/health")).json()
    kinds = {m["model"]: m.get("type") for m in health["models"]}
    assert kinds == {"tiny": None, "tiny-embed": "embedding"}


async def test_bad_input_is_400_never_500(cluster: EmbeddingCluster) -> None:
    await cluster.add_embedder()
    bodies: list[Any] = [
        {"model": "tiny-embed"}, {"model": "tiny-embed", "input": []}, {"model": "tiny-embed", "input": ""},
        {"model": "tiny-embed", "input": ["a", ""]}, {"model": "tiny-embed", "input": [[1], "x"]},
        {"model": "tiny-embed", "input": [1, -2]}, {"model": "tiny-embed", "input": [999999]},
        {"model": "tiny-embed", "input": [[]]}, {"model": "tiny-embed", "input": {"a": 1}},
        {"model": "tiny-embed", "input": "x", "encoding_format": "int8"},
        {"model": "tiny-embed", "input": "x", "dimensions": 0},
        {"model": "tiny-embed", "input": "word " * 200},  # over the 64-token context
        {"model": "tiny-embed", "input": ["x"] * 2049},
    ]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as raw:
        for body in [*bodies, b"{", b"null", b"\xff"]:
            kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
            resp = await raw.post("/v1/embeddings", **kw)
            assert resp.status_code == 400, (body, resp.status_code, resp.text)
            assert resp.json()["error"]["message"]
        assert (await raw.get("/v1/embeddings")).status_code == 405
    assert not cluster.embedders[0].requests  # all refused before routing


async def test_a_failing_worker_is_replaced(cluster: EmbeddingCluster) -> None:
    bad = await cluster.add_embedder(fail=True)
    good = await cluster.add_embedder()
    api = client(cluster)
    for _ in range(4):  # round-robin reaches the failing worker at least once
        reply = await api.embeddings.with_raw_response.create(model="tiny-embed", input="hello")
        assert reply.headers["x-dynamo-worker-instance-id"] == worker_id_hex(good.id)
    assert bad.requests and len(good.requests) == 4
    with pytest.raises(openai.InternalServerError):  # sent to the failing worker on purpose: no retry
        await api.embeddings.create(model="tiny-embed", input="hello",
                                    extra_headers={"x-dynamo-worker-instance-id": f"{bad.id:x}"})
