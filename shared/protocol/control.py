"""Worker control endpoints (request plane, beside ``generate``) and their JSON replies."""

from __future__ import annotations

from typing import Any

CLEAR_KV_BLOCKS = "clear_kv_blocks"
SLEEP = "sleep"
WAKE_UP = "wake_up"
DRAIN = "drain"
LOAD_LORA = "load_lora"
UNLOAD_LORA = "unload_lora"
LIST_LORAS = "list_loras"
KV_DUMP = "kv_dump"

CONTROL_ENDPOINTS = (CLEAR_KV_BLOCKS, SLEEP, WAKE_UP, DRAIN, LOAD_LORA, UNLOAD_LORA, LIST_LORAS, KV_DUMP)

STATUS_OK = "ok"
STATUS_ERROR = "error"


def ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"status": STATUS_OK, "message": message, **extra}


def error(message: str, **extra: Any) -> dict[str, Any]:
    return {"status": STATUS_ERROR, "message": message, **extra}
