"""The mocker's embedding mode (``--model-type embedding``): deterministic vectors at a simulated cost.

A pooling model runs one forward pass over the input and returns a vector. The mocker does the
same through its real scheduler: each input is admitted as a one-token request, so it takes
prefill time, KV blocks (and prefix-cache hits), batch slots and load like a real embedding
request, and a busy worker embeds more slowly. The vector itself does not come from the simulated
forward pass (there are no weights): it is a function of the token ids alone, so the same input
gives the same vector on every worker and every run, which is what tests and clients comparing
embeddings rely on.

The function is a hashed bag of unigrams and bigrams: every token id and every pair of adjacent
ids owns a pseudo-random direction (splitmix64 of the id and the coordinate, uniform in [-1, 1)),
and the vector is their weighted sum, L2-normalised. Inputs sharing words point in similar
directions, word order still matters, and no table of vocab x dimensions floats is kept.

``dimensions`` works as in OpenAI's text-embedding-3 (Matryoshka): the full vector truncated to its
first d coordinates and re-normalised. The sum is per coordinate, so computing only the first d
coordinates and normalising gives exactly that.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import numpy as np

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.shared.errors import ConfigError, InvalidRequestError, UnavailableError
from dynamod.shared.protocol.embedding import VECTOR_DTYPE, EmbedRequest, EmbedResponse, resolve_dimensions
from dynamod.shared.protocol.kv_transfer import KvLayout
from dynamod.shared.protocol.llm import FINISH_ABORT, FINISH_ERROR, PreprocessedRequest, StopConditions
from dynamod.shared.protocol.model_card import EmbeddingSpec

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_DIMENSIONS = 768
MAX_EMBEDDING_DIMENSIONS = 65536
BIGRAM_WEIGHT = 0.5
# Inputs with more tokens than this in total are turned into vectors on a thread, off the event loop.
_THREAD_THRESHOLD_TOKENS = 16384

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
_BIGRAM_SALT = _U64(0xD6E8FEB86659FD93)
_TO_UNIT = 2.0**-53


def add_embedding_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--embedding-dimensions", type=int,
        default=os.environ.get("DYN_EMBEDDING_DIMENSIONS", str(DEFAULT_EMBEDDING_DIMENSIONS)),  # argparse converts
        help="--model-type embedding: length of the mocker's vectors; clients may ask for fewer (truncated and "
        f"re-normalised) [env DYN_EMBEDDING_DIMENSIONS, default {DEFAULT_EMBEDDING_DIMENSIONS}]",
    )


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic, as in the reference)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _U64(30))) * _MIX1
    x = (x ^ (x >> _U64(27))) * _MIX2
    return x ^ (x >> _U64(31))


def _directions(features: np.ndarray, dimensions: int) -> np.ndarray:
    """One pseudo-random direction per feature (rows), coordinates uniform in [-1, 1)."""
    coords = np.arange(dimensions, dtype=_U64)
    with np.errstate(over="ignore"):
        bits = _splitmix64(_splitmix64(features)[:, None] ^ coords[None, :])
    return (bits >> _U64(11)).astype(np.float64) * (2.0 * _TO_UNIT) - 1.0


def deterministic_embedding(token_ids: list[int], dimensions: int) -> np.ndarray:
    """The unit float32 vector of ``token_ids`` (see the module docstring); the first ``dimensions``
    coordinates of the full vector, re-normalised."""
    if not token_ids:
        raise InvalidRequestError("an input to embed must have at least one token", param="input")
    ids = np.asarray(token_ids, dtype=_U64)
    with np.errstate(over="ignore"):
        bigrams = ((ids[:-1] << _U64(32)) | ids[1:]) ^ _BIGRAM_SALT
    features = np.concatenate([ids, bigrams])
    weights = np.concatenate([np.ones(len(ids)), np.full(len(bigrams), BIGRAM_WEIGHT)])
    unique, inverse = np.unique(features, return_inverse=True)
    counts = np.bincount(inverse, weights=weights)
    vector = counts @ _directions(unique, dimensions)
    norm = float(np.linalg.norm(vector))
    if norm == 0.0:  # not reachable with random directions; a zero vector must not divide
        vector = np.zeros(dimensions)
        vector[0] = 1.0
        norm = 1.0
    return (vector / norm).astype(VECTOR_DTYPE)


def embed_all(inputs: list[list[int]], dimensions: int) -> list[bytes]:
    return [deterministic_embedding(ids, dimensions).tobytes() for ids in inputs]


class MockerEmbeddingEngine(MockerEngine):
    """A mocker worker serving ``embed``: the scheduler models the cost, the hash gives the vector."""

    def __init__(
        self, config: MockerConfig, worker_id: int, *, dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
        kv_layout: KvLayout | None = None,
    ) -> None:
        if not 1 <= dimensions <= MAX_EMBEDDING_DIMENSIONS:
            raise ConfigError(f"--embedding-dimensions must be in [1, {MAX_EMBEDDING_DIMENSIONS}], got {dimensions}")
        super().__init__(config, worker_id, kv_layout=kv_layout)
        self.embedding = EmbeddingSpec(dimensions=dimensions, matryoshka=True)
        info = self.info
        info.embedding = self.embedding
        # The scheduler needs room for the one simulated output token after the input.
        info.context_length = max(1, config.context_length - 1)

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        dims = resolve_dimensions(request.dimensions, self.embedding)
        if not request.inputs:
            raise InvalidRequestError("nothing to embed: 'input' is empty", param="input")
        vocab = self.config.vocab_size
        limit = self.info.context_length
        for i, ids in enumerate(request.inputs):
            if not ids:
                raise InvalidRequestError(f"input {i} has no tokens", param="input")
            if len(ids) > limit:
                raise InvalidRequestError(
                    f"input {i} has {len(ids)} tokens; this model embeds at most {limit}", param="input"
                )
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"token id {bad} in input {i} is outside the vocabulary [0, {vocab})", param="input")
        # A TaskGroup: one failed or cancelled input ends the others (their streams abort in the engine).
        async with asyncio.TaskGroup() as group:
            for i, ids in enumerate(request.inputs):
                group.create_task(self._simulate(f"{request.request_id}#{i}", request, ids))
        total = sum(len(ids) for ids in request.inputs)
        if total > _THREAD_THRESHOLD_TOKENS:
            vectors = await asyncio.to_thread(embed_all, request.inputs, dims)
        else:
            vectors = embed_all(request.inputs, dims)
        return EmbedResponse(embeddings=vectors, dimensions=dims, prompt_tokens=total)

    async def _simulate(self, request_id: str, request: EmbedRequest, token_ids: list[int]) -> None:
        """One input through the scheduler as a one-token request: the forward pass's time and KV."""
        pre = PreprocessedRequest(
            request_id=request_id, model=request.model, token_ids=token_ids,
            stop=StopConditions(max_tokens=1, ignore_eos=True), lora_name=request.lora_name,
        )
        async for out in self.generate(pre):
            if out.finish_reason == FINISH_ABORT:
                raise UnavailableError(f"worker {self.worker_id:x} aborted the embedding (asleep or stopping)")
            if out.finish_reason == FINISH_ERROR:
                raise UnavailableError(f"worker {self.worker_id:x} failed the embedding: {out.error or 'no detail'}")
