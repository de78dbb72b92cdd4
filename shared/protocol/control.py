"""Worker control endpoints (request plane, beside ``generate``): their names, their request
bodies and their JSON replies.

The bodies are msgspec structs defined once here: the worker decodes with them (``parse_body``),
and the console and ``dynamoctl`` build them and send ``encode_body(...)``. A body that does not
match gets ``InvalidRequestError`` naming the field, so a bad call gets a one-line answer instead of
a crashed handler. The wire is a plain map (msgpack) of the fields; ``ClearKvRequest`` leaves out an
unset tier, as the console always did.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from dynamod.shared.errors import InvalidRequestError

CLEAR_KV_BLOCKS = "clear_kv_blocks"
SLEEP = "sleep"
WAKE_UP = "wake_up"
DRAIN = "drain"
LOAD_LORA = "load_lora"
UNLOAD_LORA = "unload_lora"
LIST_LORAS = "list_loras"
KV_DUMP = "kv_dump"
TRACES = "traces"  # the spans this process holds for a request or trace (shared/observability/tracing.py)

CONTROL_ENDPOINTS = (CLEAR_KV_BLOCKS, SLEEP, WAKE_UP, DRAIN, LOAD_LORA, UNLOAD_LORA, LIST_LORAS, KV_DUMP, TRACES)

STATUS_OK = "ok"
STATUS_ERROR = "error"

DEFAULT_REPLY_TIMEOUT_S = 30.0
# A waiting drain answers once in-flight requests finished or its own timeout passed: the caller
# waits that long and this much more for the reply.
DRAIN_REPLY_SLACK_S = 10.0

B = TypeVar("B", bound="ControlBody")


class ControlBody(msgspec.Struct):
    """Base of every control request body."""

    def reply_timeout_s(self) -> float:
        """How long a caller waits for the reply to this request."""
        return DEFAULT_REPLY_TIMEOUT_S


class SleepRequest(ControlBody, forbid_unknown_fields=True):
    level: int = 1


class DrainRequest(ControlBody, forbid_unknown_fields=True):
    wait: bool = True
    timeout_s: float = 300.0

    def reply_timeout_s(self) -> float:
        return self.timeout_s + DRAIN_REPLY_SLACK_S


class LoraSource(msgspec.Struct):
    uri: str


class LoadLoraRequest(ControlBody, forbid_unknown_fields=True):
    lora_name: str
    source: LoraSource | str


class UnloadLoraRequest(ControlBody, forbid_unknown_fields=True):
    lora_name: str


class EmptyRequest(ControlBody):
    """``wake_up``, ``list_loras``, ``kv_dump``: no fields (extra ones are ignored)."""


class ClearKvRequest(ControlBody, forbid_unknown_fields=True, omit_defaults=True):
    medium: str | None = None  # one KV tier (kv_events.MEDIA: GPU, CPU, DISK); None: every tier


class TracesRequest(ControlBody, forbid_unknown_fields=True):
    """``traces``: the spans of one request (its ``x-request-id``) and/or one trace; neither: the
    most recent spans. The reply is ``ok(..., spans=[span, ...])``, at most ``limit`` of them."""

    request_id: str | None = None
    trace_id: str | None = None
    limit: int = 1000


def encode_body(body: ControlBody) -> dict[str, Any]:
    """The map sent on the request plane."""
    return msgspec.to_builtins(body)  # type: ignore[no-any-return]


def parse_body(body: Any, cls: type[B], endpoint: str) -> B:
    """The worker's side: ``body`` as received (a map, or nothing) checked into ``cls``."""
    if body is None:
        body = {}
    try:
        return msgspec.convert(body, cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"bad {endpoint} request: {exc}") from None


def ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"status": STATUS_OK, "message": message, **extra}


def error(message: str, **extra: Any) -> dict[str, Any]:
    return {"status": STATUS_ERROR, "message": message, **extra}
