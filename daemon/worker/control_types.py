"""Request bodies of the worker control endpoints, validated with msgspec.

A body that does not match gets ``InvalidRequestError`` naming the field, so a bad ``dynamoctl`` or
console call gets a one-line answer instead of a crashed handler.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from dynamod.shared.errors import InvalidRequestError

T = TypeVar("T")


class SleepRequest(msgspec.Struct, forbid_unknown_fields=True):
    level: int = 1


class DrainRequest(msgspec.Struct, forbid_unknown_fields=True):
    wait: bool = True
    timeout_s: float = 300.0


class LoraSource(msgspec.Struct):
    uri: str


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    source: LoraSource | str


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str


class EmptyRequest(msgspec.Struct):
    pass


class ClearKvRequest(msgspec.Struct, forbid_unknown_fields=True):
    medium: str | None = None  # one KV tier (kv_events.MEDIA: GPU, CPU, DISK); None: every tier


def parse_body(body: Any, cls: type[T], endpoint: str) -> T:
    if body is None:
        body = {}
    try:
        return msgspec.convert(body, cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"bad {endpoint} request: {exc}") from None
