"""Router replica sync: the envelope of active-sequence changes on ``active_sequences_events``.

Each router replica publishes its own requests' add / prefill-done / free changes so every replica
counts every request's load. One envelope carries a batch of changes of one router, each already
encoded as ``shared/kv/router_sync`` encodes it (the receiver decodes them one by one and skips
its own). msgpack.
"""

from __future__ import annotations

import msgspec


class SyncEnvelope(msgspec.Struct, kw_only=True):
    """One router's active-sequence changes. ``model`` is the replica key (the frontend's base
    model name, the router role's worker component; the field name is kept from the first
    frontends that sent these)."""

    model: str
    events: list[bytes]


sync_envelope_encoder = msgspec.msgpack.Encoder()
sync_envelope_decoder = msgspec.msgpack.Decoder(SyncEnvelope)
