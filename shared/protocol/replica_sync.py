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


# -- session affinity ---------------------------------------------------------------------------------
#
# Router replicas also share which worker each session (``x-dynamo-session-id``) is bound to, so a
# second frontend routes the session where the first one did. Every router mode keeps sessions, so
# these travel on their own topic (in the same component scope as the active-sequence changes), not
# inside the KV router's envelopes, which only the kv mode sends.

TOPIC_SESSION_AFFINITY = "session_affinity_events"


class SessionBound(msgspec.Struct, kw_only=True):
    """A session's binding as one router holds it after routing one of its requests.

    ``epoch`` counts the session's moves: a binding with a higher epoch replaces a lower one on
    every replica (the session moved off a drained or busy worker); two bindings of one epoch on
    different workers (two replicas routed a new session at once) are settled by the smaller
    ``origin``, the router that made the binding, so every replica ends up with the same one.
    ``ttl_s``: the idle time after which the binding lapses. ``closed``: the client ended the
    session (``nvext.session_control.action = "close"``); replicas drop it."""

    router_id: int  # the sender
    session_id: str
    worker_id: int
    dp_rank: int = 0
    epoch: int = 0
    origin: int = 0
    ttl_s: float = 0.0
    closed: bool = False


class SessionEnvelope(msgspec.Struct, kw_only=True):
    """One router's session bindings; ``model`` is the replica key (the served model name)."""

    model: str
    sessions: list[SessionBound]


session_envelope_encoder = msgspec.msgpack.Encoder()
session_envelope_decoder = msgspec.msgpack.Decoder(SessionEnvelope)
