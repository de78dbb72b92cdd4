"""The ``encode`` endpoint's wire types (msgpack on the request plane): the encode pool.

An encode worker (``dynamod --role encode``, component ``encoder``) runs a model's vision encoder
for the frontend. Its model card has model type ``encode`` and the base model's served name, so a
frontend keeps one encoder pool per model, as it keeps a prefill pool. Flow (pull, as for KV):

1. the frontend routes the request, then sends the images whose tokens the chosen worker does not
   fully cache as one ``EncodeRequest`` (content hash, size after the processor, the image bytes);
2. the encode worker encodes them (batched under a token budget), keeps each embedding
   (``num_tokens x hidden_size x dtype``) in pages of its registered memory and answers with one
   ``EmbeddingParams`` per image: where the pages are, how to reach them (``KvTransferMetadata``:
   NIXL or the TCP block transport, the KV transfer layer's own agents) and a checksum;
3. the params ride on the request (``MultimodalItem.embedding``); the prefill/agg worker reads the
   pages before the prefill (or finds the embedding in its cache by content hash), the read's
   notification frees them on the encode worker (or ``expires_at`` does).

An image left without params (no encode worker, or the pool failed twice) is encoded by the
prefill/agg worker itself: the request completes either way.
"""

from __future__ import annotations

import msgspec

from dynamod.shared.protocol.kv_transfer import KvTransferMetadata

ENCODE_ENDPOINT = "encode"
ENCODER_COMPONENT = "encoder"
ROLE_ENCODE = "encode"
EMBEDDING_DTYPE = "bfloat16"  # what a VL model's vision tower hands the language model
EMBEDDING_DTYPE_BYTES = 2
# Tokens per page of embedding memory: the KV block size of the shipped models, so a page of
# embedding and a KV block are moved by the same transfer machinery in the same units.
EMBEDDING_PAGE_TOKENS = 16


class EncodeItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image to encode: ``MultimodalItem``'s identity and size, and the image bytes as the
    client sent them (empty when the frontend no longer has them: an encoder that needs the pixels
    then fails the item and the prefill worker encodes it)."""

    mm_hash: str
    num_tokens: int
    width: int = 0
    height: int = 0
    data: bytes = b""


class EncodeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    model: str
    items: list[EncodeItem]


class EmbeddingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where one image's embedding waits on an encode worker (``MultimodalItem.embedding``).

    ``block_ids`` index the encode worker's embedding memory (``agent.block_bytes`` each; the
    last page is zero-padded); ``checksum`` is xxh3_64 over those pages in order
    (``KvBlockMemory.checksum``), which the reader verifies."""

    transfer_id: str
    worker_id: int  # the encode worker's instance id
    agent: KvTransferMetadata
    block_ids: list[int]
    num_tokens: int
    hidden_size: int
    dtype: str = EMBEDDING_DTYPE
    checksum: int = 0
    expires_at: float = 0.0  # wall clock after which the encode worker frees the pages

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.hidden_size * EMBEDDING_DTYPE_BYTES


class EncodeReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One frame: the params of each item, in the request's order; ``encode_ms`` the encoder time."""

    embeddings: list[EmbeddingParams]
    encode_ms: float = 0.0
