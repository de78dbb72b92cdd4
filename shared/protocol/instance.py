"""The instance record stored under ``v1/instances/...`` (JSON)."""

from __future__ import annotations

import msgspec

STATUS_READY = "ready"
STATUS_DRAINING = "draining"
STATUS_SLEEPING = "sleeping"
STATUSES = (STATUS_READY, STATUS_DRAINING, STATUS_SLEEPING)


class Instance(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One served endpoint of one process (or of one worker inside a multi-worker process).

    ``transport`` is ``tcp`` (``address`` is ``host:port``) or ``nats`` (``address`` is the subject).
    Routers send new work only to ``status == "ready"`` instances.
    """

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    transport: str
    address: str
    node: str = ""
    pid: int = 0
    role: str = ""
    status: str = STATUS_READY
    model: str = ""
    labels: dict[str, str] = {}
    started_at: float = 0.0
    system_url: str = ""  # http://host:port of the process's /health,/metrics server

    @property
    def routable(self) -> bool:
        return self.status == STATUS_READY


def encode_instance(inst: Instance) -> bytes:
    return msgspec.json.encode(inst)


def decode_instance(data: bytes) -> Instance:
    return msgspec.json.decode(data, type=Instance)
