"""The mocker's embedding mode: deterministic unit vectors, Matryoshka truncation, and inputs that
really pass through the scheduler (KV blocks, prefix cache)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.embedding import MockerEmbeddingEngine, deterministic_embedding
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.protocol.embedding import VECTOR_DTYPE, EmbedRequest, resolve_dimensions
from dynamod.shared.protocol.kv_events import KvStored
from dynamod.shared.protocol.model_card import EmbeddingSpec


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_vectors_are_deterministic_unit_and_truncate_like_matryoshka() -> None:
    ids = [5, 17, 300, 17, 9]
    full = deterministic_embedding(ids, 256)
    assert full.dtype == np.dtype(VECTOR_DTYPE) and full.shape == (256,)
    assert np.array_equal(full, deterministic_embedding(list(ids), 256))
    assert abs(float(np.linalg.norm(full)) - 1.0) < 1e-5
    short = deterministic_embedding(ids, 32)
    expected = full[:32].astype(np.float64) / np.linalg.norm(full[:32].astype(np.float64))
    assert np.allclose(short, expected, atol=1e-6)
    # Order matters (bigrams), and any change of input changes the vector.
    assert not np.allclose(full, deterministic_embedding(ids[::-1], 256))
    assert not np.allclose(full, deterministic_embedding([*ids, 1], 256))


def test_shared_tokens_point_the_same_way() -> None:
    base = list(range(100, 140))
    near = [*base[:30], 900, 901, 902, *base[33:]]
    far = list(range(2000, 2040))
    v, n, f = (deterministic_embedding(x, 512) for x in (base, near, far))
    assert _cos(v, n) > 0.6 > 0.3 > abs(_cos(v, f))


def test_resolve_dimensions() -> None:
    spec = EmbeddingSpec(dimensions=64, matryoshka=True)
    assert resolve_dimensions(None, spec) == 64 and resolve_dimensions(8, spec) == 8
    for bad in (0, 65):
        with pytest.raises(InvalidRequestError) as info:
            resolve_dimensions(bad, spec)
        assert info.value.param == "dimensions"
    fixed = EmbeddingSpec(dimensions=64)
    assert resolve_dimensions(64, fixed) == 64
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        resolve_dimensions(32, fixed)
    listed = EmbeddingSpec(dimensions=64, matryoshka=True, matryoshka_dimensions=[16, 64])
    assert resolve_dimensions(16, listed) == 16
    with pytest.raises(InvalidRequestError, match="16, 64"):
        resolve_dimensions(32, listed)


@pytest.fixture
async def engine() -> AsyncIterator[MockerEmbeddingEngine]:
    config = MockerConfig(num_gpu_blocks=64, block_size=16, vocab_size=1000, speedup_ratio=50.0)
    eng = MockerEmbeddingEngine(config, worker_id=7, dimensions=48)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def test_engine_embeds_through_the_scheduler(engine: MockerEmbeddingEngine) -> None:
    assert engine.info.embedding == EmbeddingSpec(dimensions=48, matryoshka=True)
    assert engine.info.context_length == 64 * 16 - 1  # one slot kept for the simulated output token
    inputs = [list(range(1, 41)), [3, 4, 5]]
    reply = await engine.embed(EmbedRequest(request_id="r1", model="m", inputs=inputs))
    assert reply.dimensions == 48 and reply.prompt_tokens == 43
    vectors = [np.frombuffer(v, dtype=VECTOR_DTYPE) for v in reply.embeddings]
    assert np.array_equal(vectors[0], deterministic_embedding(inputs[0], 48))
    assert np.array_equal(vectors[1], deterministic_embedding(inputs[1], 48))
    # The 40-token input left two full blocks in the prefix cache, as a real forward pass would.
    dumped = await engine.kv_dump()
    assert sum(len(ev.event.blocks) for ev in dumped if isinstance(ev.event, KvStored)) >= 2
    assert engine.num_active_requests == 0

    short = await engine.embed(EmbedRequest(request_id="r2", model="m", inputs=[inputs[1]], dimensions=12))
    assert short.dimensions == 12 and len(short.embeddings[0]) == 12 * 4


async def test_engine_refuses_bad_requests(engine: MockerEmbeddingEngine) -> None:
    bad = [
        EmbedRequest(request_id="a", model="m", inputs=[]),
        EmbedRequest(request_id="b", model="m", inputs=[[]]),
        EmbedRequest(request_id="c", model="m", inputs=[[1, 1000]]),
        EmbedRequest(request_id="d", model="m", inputs=[[1]], dimensions=49),
        EmbedRequest(request_id="e", model="m", inputs=[[1] * 1024]),
    ]
    for request in bad:
        with pytest.raises(InvalidRequestError):
            await engine.embed(request)
    assert engine.num_active_requests == 0


async def test_cancelled_embedding_frees_its_requests() -> None:
    config = MockerConfig(num_gpu_blocks=64, block_size=16, vocab_size=1000, speedup_ratio=0.01)
    engine = MockerEmbeddingEngine(config, worker_id=8, dimensions=8)  # slow: still running when cancelled
    await engine.start()
    try:
        task = asyncio.create_task(engine.embed(EmbedRequest(request_id="slow", model="m", inputs=[[1] * 500, [2] * 500])))

        async def running() -> None:
            while engine.num_active_requests < 2:  # noqa: ASYNC110 - a condition with a deadline, polled
                await asyncio.sleep(0.005)

        await asyncio.wait_for(running(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_active_requests == 0
    finally:
        await engine.stop()


def test_dimensions_flag_is_checked() -> None:
    with pytest.raises(ConfigError):
        MockerEmbeddingEngine(MockerConfig(vocab_size=10), worker_id=1, dimensions=0)
