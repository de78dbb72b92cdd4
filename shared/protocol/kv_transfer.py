"""Wire types of disaggregated serving: KV block geometry, transfer agents and transfer parameters.

A worker that takes part in disaggregation registers its KV block memory with a transfer agent
(NIXL over UCX where ``nixl`` is installed, our own TCP block transport otherwise) and advertises
the agent under ``v1/kv_transfer/{ns}/{component}/{worker_id:x}`` (JSON, under the worker's lease),
so a peer that is handed a ``KvTransferParams`` can find out how to reach the blocks it names.

Flow (pull; the decode side reads, as vLLM's NixlConnector does):

1. the frontend sends the prompt to a prefill worker with ``prefill_only``; the worker computes its
   KV, keeps the blocks (refcount held, not freed at finish) and answers with a final frame whose
   ``disaggregated_params`` is ``msgspec.to_builtins(KvTransferParams)``;
2. the frontend sends the request to a decode worker with those params; the decode worker looks
   up the prefill worker's ``KvTransferMetadata``, allocates local blocks, reads the remote blocks
   it does not already cache into them (with a deadline), then decodes;
3. the read carries ``transfer_id`` as its completion notification; the prefill worker frees the
   held blocks when it arrives, or when ``expires_at`` passes.

If the read fails (peer gone, deadline passed, bad metadata) the decode worker prefills locally:
the request completes either way. Engines with their own connector (vLLM's NixlConnector, SGLang's
bootstrap, TensorRT-LLM's context/generation params) put their own dict in
``disaggregated_params`` instead; the frontend treats it as opaque.
"""

from __future__ import annotations

import msgspec

BACKEND_TCP = "tcp"
BACKEND_NIXL = "nixl"
BACKENDS = (BACKEND_TCP, BACKEND_NIXL)


class KvLayout(msgspec.Struct, kw_only=True, frozen=True):
    """The shape of one KV block as an engine holds it: K and V for every layer.

    ``block_bytes = num_layers * num_kv_heads * head_dim * 2 * dtype_bytes * block_size``, so a
    transfer moves the bytes a real engine with this model would move."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size


class KvTransferMetadata(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to reach one worker's registered KV block memory (``v1/kv_transfer/...``).

    ``address`` is ``host:port`` of the TCP block server (always present: NIXL peers also use it
    as the fallback). ``nixl_metadata`` is the NIXL agent's serialized metadata
    (``get_agent_metadata()``; base64 in JSON), empty when the worker has no NIXL agent.
    Block ids in ``KvTransferParams`` index the region ``[0, num_blocks)`` of ``block_bytes`` each."""

    worker_id: int
    backend: str  # BACKEND_NIXL | BACKEND_TCP: what the worker prefers to be read with
    agent_name: str
    address: str
    num_blocks: int
    block_bytes: int
    layout: KvLayout | None = None
    nixl_metadata: bytes = b""
    # Address of block 0 in the agent's registered memory: NIXL names remote memory by address,
    # so a reader builds its descriptors as ``base_address + id * block_bytes``. 0 without NIXL.
    base_address: int = 0


class KvTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The prefill worker's answer: which of its blocks hold the prompt's KV, and until when.

    ``block_ids`` cover the whole prompt (the last one may be partial), in order; ``block_hashes``
    are the router's sequence hashes of the *full* ones (``len(block_hashes) <= len(block_ids)``),
    so the decode worker can skip blocks it already caches. ``checksum`` is xxh3_64 over the bytes
    of ``block_ids`` in order, as the prefill worker computed them (the decode side verifies it)."""

    transfer_id: str
    worker_id: int  # the prefill worker's instance id
    dp_rank: int = 0
    backend: str = BACKEND_TCP
    block_ids: list[int]
    block_hashes: list[int] = []
    num_tokens: int  # prompt tokens whose KV is held
    cached_tokens: int = 0  # of them, tokens the prefill worker found in its prefix cache
    first_token: int | None = None  # the token the prefill worker sampled (not streamed)
    expires_at: float = 0.0  # wall clock (time.time()) after which the blocks are freed
    checksum: int | None = None
    # Streamed (KV transfer overlapped with the prefill): sent when the prompt was admitted, before
    # its blocks are computed; the decode worker reads them as they become ready and gets the
    # checksum with the last one (``first_token`` and ``checksum`` are unset).
    streaming: bool = False
    computed_at: float = 0.0  # wall clock when the last block was computed (0: not yet, streamed)


kv_transfer_metadata_encoder = msgspec.json.Encoder()


def encode_transfer_metadata(meta: KvTransferMetadata) -> bytes:
    return kv_transfer_metadata_encoder.encode(meta)


def decode_transfer_metadata(data: bytes) -> KvTransferMetadata:
    return msgspec.json.decode(data, type=KvTransferMetadata)
