"""Discovery key layout (``v1/...``), exactly as DESIGN.md fixes it.

Keys are plain strings; values are JSON-encoded wire structs. Instance ids are printed in lowercase
hex without ``0x``, like Dynamo, so ``etcdctl get --prefix v1/instances`` reads the same on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamod.shared.errors import InvalidRequestError

INSTANCES_ROOT = "v1/instances/"
MDC_ROOT = "v1/mdc/"
MDC_FILES_ROOT = "v1/mdc_files/"
EVENT_CHANNELS_ROOT = "v1/event_channels/"
KV_TRANSFER_ROOT = "v1/kv_transfer/"
PLANNER_ROOT = "v1/planner/"
INTENT_ROOT = "v1/intent/"


def _check_segment(name: str, what: str) -> str:
    if not name or "/" in name:
        raise InvalidRequestError(f"{what} must be a non-empty name without '/', got {name!r}")
    return name


def instance_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    return (
        f"{INSTANCES_ROOT}{_check_segment(namespace, 'namespace')}/{_check_segment(component, 'component')}/"
        f"{_check_segment(endpoint, 'endpoint')}/{instance_id:x}"
    )


def instances_prefix(namespace: str | None = None, component: str | None = None, endpoint: str | None = None) -> str:
    """Prefix for a watch: all instances, a namespace's, a component's, or one endpoint's."""
    parts = [p for p in (namespace, component, endpoint) if p is not None]
    return INSTANCES_ROOT + "".join(f"{p}/" for p in parts)


def mdc_key(namespace: str, component: str, endpoint: str, instance_id: int, lora: str | None = None) -> str:
    key = f"{MDC_ROOT}{namespace}/{component}/{endpoint}/{instance_id:x}"
    return f"{key}/{_check_segment(lora, 'lora name')}" if lora else key


def mdc_prefix(namespace: str | None = None) -> str:
    return MDC_ROOT + (f"{namespace}/" if namespace else "")


def mdc_files_prefix(namespace: str, sha256: str) -> str:
    """Everything of one tokenizer-files bundle (``shared/protocol/model_files.py``)."""
    if not sha256 or not all(c in "0123456789abcdef" for c in sha256):
        raise InvalidRequestError(f"a model files hash is lowercase hex, got {sha256!r}")
    return f"{MDC_FILES_ROOT}{_check_segment(namespace, 'namespace')}/{sha256}/"


def mdc_files_copies_prefix(namespace: str, sha256: str) -> str:
    """The holders of a bundle: one ``ModelFilesCopy`` per worker holding a copy."""
    return f"{mdc_files_prefix(namespace, sha256)}copies/"


def mdc_files_copy_key(namespace: str, sha256: str, instance_id: int) -> str:
    return f"{mdc_files_copies_prefix(namespace, sha256)}{instance_id:x}"


def mdc_files_chunks_prefix(namespace: str, sha256: str, instance_id: int) -> str:
    """The chunks of one holder's copy, ``{index:05d}`` in order."""
    return f"{mdc_files_prefix(namespace, sha256)}chunks/{instance_id:x}/"


def mdc_files_chunk_key(namespace: str, sha256: str, instance_id: int, index: int) -> str:
    return f"{mdc_files_chunks_prefix(namespace, sha256, instance_id)}{index:05d}"


def event_channel_key(namespace: str, component: str, topic: str, instance_id: int) -> str:
    return f"{EVENT_CHANNELS_ROOT}{namespace}/{component}/{topic}/{instance_id:x}"


def event_channels_prefix(namespace: str, component: str | None = None, topic: str | None = None) -> str:
    parts = [p for p in (namespace, component, topic) if p is not None]
    return EVENT_CHANNELS_ROOT + "".join(f"{p}/" for p in parts)


def kv_transfer_key(namespace: str, component: str, instance_id: int) -> str:
    """Where a worker advertises its KV transfer agent (``KvTransferMetadata``, JSON)."""
    return f"{KV_TRANSFER_ROOT}{_check_segment(namespace, 'namespace')}/{_check_segment(component, 'component')}/{instance_id:x}"


def kv_transfer_prefix(namespace: str, component: str | None = None) -> str:
    parts = [p for p in (namespace, component) if p is not None]
    return KV_TRANSFER_ROOT + "".join(f"{p}/" for p in parts)


def planner_status_key(namespace: str) -> str:
    """The planner's ``PlannerStatus`` (under its lease)."""
    return f"{PLANNER_ROOT}{_check_segment(namespace, 'namespace')}/status"


def planner_desired_key(namespace: str) -> str:
    """``DesiredReplicas`` from the planner's virtual/local connector (no lease)."""
    return f"{PLANNER_ROOT}{_check_segment(namespace, 'namespace')}/desired"


def planner_scaled_key(namespace: str) -> str:
    """``ScaledReplicas`` from whoever carried the desired counts out (no lease)."""
    return f"{PLANNER_ROOT}{_check_segment(namespace, 'namespace')}/scaled"


def planner_scaler_key(namespace: str) -> str:
    """A ``ScalerRecord`` under the lease of whoever carries ``DesiredReplicas`` out on this host
    (the ``dynamod up`` supervisor): the local connector's proof that someone will act."""
    return f"{PLANNER_ROOT}{_check_segment(namespace, 'namespace')}/scaler"


def planner_override_key(namespace: str, pool: str) -> str:
    """An operator's ``ScaleOverride`` for one pool (no lease; deleted to clear it)."""
    return f"{PLANNER_ROOT}{_check_segment(namespace, 'namespace')}/override/{_check_segment(pool, 'pool')}"


def planner_override_prefix(namespace: str) -> str:
    return f"{PLANNER_ROOT}{_check_segment(namespace, 'namespace')}/override/"


def intent_key(namespace: str, component: str, worker_name: str) -> str:
    """An operator's intent for one worker (drain/sleep status, loaded LoRA adapters), keyed by
    the worker's stable name rather than its instance id, and not under any lease: it outlives
    the process so a restarted worker re-applies it."""
    return (
        f"{INTENT_ROOT}{_check_segment(namespace, 'namespace')}/{_check_segment(component, 'component')}/"
        f"{_check_segment(worker_name, 'worker name')}"
    )


def intent_prefix(namespace: str | None = None, component: str | None = None) -> str:
    parts = [p for p in (namespace, component) if p is not None]
    return INTENT_ROOT + "".join(f"{p}/" for p in parts)


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """The parts of a ``v1/instances|mdc|event_channels`` key."""

    root: str
    namespace: str
    component: str
    name: str  # endpoint for instances/mdc, topic for event channels
    instance_id: int
    lora: str | None = None


def parse_key(key: str) -> ParsedKey | None:
    """Parses any v1 key; returns None for keys of another layout (never raises)."""
    for root in (INSTANCES_ROOT, MDC_ROOT, EVENT_CHANNELS_ROOT):
        if key.startswith(root):
            parts = key[len(root) :].split("/")
            if len(parts) not in (4, 5) or (len(parts) == 5 and root != MDC_ROOT):
                return None
            try:
                iid = int(parts[3], 16)
            except ValueError:
                return None
            return ParsedKey(root, parts[0], parts[1], parts[2], iid, parts[4] if len(parts) == 5 else None)
    return None
