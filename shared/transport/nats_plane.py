"""The NATS request plane: the same RequestPlaneServer / RequestPlaneClient contract as TCP, carried
over NATS subjects (see ``nats_wire`` for the subjects and messages). Chosen with
``DYN_REQUEST_PLANE=nats``; useful where workers cannot accept inbound TCP connections.
"""

from __future__ import annotations

from dynamod.shared.transport.nats_client import NatsClientStream, NatsRequestClient
from dynamod.shared.transport.nats_server import NatsRequestServer
from dynamod.shared.transport.nats_wire import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_NATS_URL,
    SUBJECT_PREFIX,
    control_subject,
    endpoint_subject,
    resolve_nats_url,
)

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_NATS_URL",
    "SUBJECT_PREFIX",
    "NatsClientStream",
    "NatsRequestClient",
    "NatsRequestServer",
    "control_subject",
    "endpoint_subject",
    "resolve_nats_url",
]
