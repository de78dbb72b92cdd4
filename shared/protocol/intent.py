"""An operator's intent for one worker, kept in discovery so it outlives the worker's process.

Stored at ``v1/intent/{ns}/{component}/{worker_name}`` (``keys.intent_key``, JSON) with NO lease:
a drained worker that is restarted must come back draining, a sleeping one sleeping (at the same
level), and the LoRA adapters an operator loaded must be loaded again. The key is named by the
worker's stable name (``--worker-name``), not by its instance id, which changes with every process.

Only what an operator asked for lives here: ``drain``, ``sleep {level}``, ``load_lora`` set it;
``wake_up`` and ``unload_lora`` clear it (``clear_kv_blocks`` is a one-off, not intent). A worker
with nothing to remember (ready, no adapters) has no key at all, so listing the prefix shows
exactly the workers that will not come back plain ``ready``.
"""

from __future__ import annotations

import msgspec

from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUS_READY, STATUS_SLEEPING, STATUSES

SLEEP_LEVELS = (1, 2)


class WorkerIntent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the operator asked of one worker. Validated on decode (``__post_init__``), so a bad
    value written by hand is refused as a whole rather than half-applied at start."""

    status: str = STATUS_READY  # ready | draining | sleeping
    sleep_level: int = 0  # 1 or 2 while sleeping, else 0
    loras: dict[str, str] = {}  # adapter name -> source (path or URI) it was loaded from
    ts: float = 0.0  # unix time of the last change
    set_by: str = ""  # the control action that made the last change (drain, sleep, load_lora, ...)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"intent status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        if self.status == STATUS_SLEEPING and self.sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"a sleeping intent needs sleep_level 1 or 2, got {self.sleep_level}")
        if self.status != STATUS_SLEEPING and self.sleep_level:
            raise ValueError(f"sleep_level is only meaningful while sleeping (status {self.status!r})")
        for name in self.loras:
            if not name or "/" in name:
                raise ValueError(f"LoRA adapter names must be non-empty without '/', got {name!r}")

    @property
    def empty(self) -> bool:
        """Nothing to re-apply: the worker would come back like this anyway (so no key is kept)."""
        return self.status == STATUS_READY and not self.loras

    @property
    def draining(self) -> bool:
        return self.status == STATUS_DRAINING

    @property
    def sleeping(self) -> bool:
        return self.status == STATUS_SLEEPING

    def same_as(self, other: WorkerIntent) -> bool:
        """Equal in what is re-applied (``ts`` and ``set_by`` are bookkeeping)."""
        return (self.status, self.sleep_level, self.loras) == (other.status, other.sleep_level, other.loras)


def encode_intent(intent: WorkerIntent) -> bytes:
    return msgspec.json.encode(intent)


def decode_intent(data: bytes) -> WorkerIntent:
    """Raises ``msgspec.DecodeError`` (``ValidationError`` included) for a value that is not a
    valid intent; unknown fields are ignored, so a newer writer's additions do not break a reader."""
    return msgspec.json.decode(data, type=WorkerIntent)
