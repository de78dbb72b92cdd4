"""Active-sequence changes that router replicas exchange (``active_sequences_events`` topic).

With several routers in front of one pool (several frontends, ``--router-replica-sync``), each
router only sees its own requests; publishing add / prefill-done / free lets every replica count
every request's load. An add carries the prompt's *local* block hashes (the receiver rebuilds the
chained hashes, and in approximate mode also records the prompt as cached on the chosen worker)
and the overlap the sender saw, so all replicas charge the same prefill tokens.

An add also says whether the request is *arriving* (a decode whose prompt was prefilled on a
prefill worker, its KV still being fetched): such a request counts neither prefill tokens nor
blocks on its worker until its first token, which the sender publishes as its prefill-done, so
replicas count it exactly as the sender does. A message from a peer that predates the field
decodes as not arriving (its old behaviour), and older peers ignore the field.
"""

from __future__ import annotations

import msgspec


class SequenceAdded(msgspec.Struct, tag="add", kw_only=True):
    router_id: int
    request_id: str
    worker_id: int
    dp_rank: int = 0
    isl: int  # prompt tokens
    overlap_blocks: int  # prompt blocks already cached on the worker when routed
    local_hashes: list[int]  # local hashes of the prompt's full blocks
    arriving: bool = False  # KV fetched from a prefill worker: load counted from prefill-done on


class SequencePrefillDone(msgspec.Struct, tag="prefill_done", kw_only=True):
    router_id: int
    request_id: str


class SequenceFreed(msgspec.Struct, tag="free", kw_only=True):
    router_id: int
    request_id: str


ActiveSequenceEvent = SequenceAdded | SequencePrefillDone | SequenceFreed

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ActiveSequenceEvent)


def encode_sequence_event(event: ActiveSequenceEvent) -> bytes:
    return _encoder.encode(event)


def decode_sequence_event(payload: bytes) -> ActiveSequenceEvent:
    return _decoder.decode(payload)
