"""Worker health notices that frontends share on ``{namespace}/frontend/frontend_worker_health``.

A frontend that finds a worker unreachable tells its peers, so none of them walks into the dead
worker while its discovery record waits for the lease to expire. msgpack; a frontend ignores the
notices it sent itself (``sender`` is its instance id).
"""

from __future__ import annotations

import msgspec

TOPIC_WORKER_HEALTH = "frontend_worker_health"

# RoutingNotice.kind values.
KIND_WORKER_DOWN = "worker_down"


class RoutingNotice(msgspec.Struct, kw_only=True, omit_defaults=True):
    sender: int  # the publishing frontend's instance id
    kind: str  # one of KIND_*
    worker_id: int = 0  # the worker the notice is about


routing_notice_encoder = msgspec.msgpack.Encoder()
routing_notice_decoder = msgspec.msgpack.Decoder(RoutingNotice)
