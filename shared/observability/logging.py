"""Process logging: one line per event, ``key=value`` fields, level from ``DYN_LOG``.

``DYN_LOG`` takes a level name (``debug``, ``info``, ``warning``, ``error``); ``DYN_LOGGING_JSONL=1``
switches to one JSON object per line for log shippers. Messages are written as
``"event key=value key=value"`` by the callers; this module only frames them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from typing import Any

_CONFIGURED = False

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("dynamod_log_request_id", default=None)
"""The client-visible request id (``x-request-id``) of the request the current task serves: set by
the frontend per HTTP request and by a worker per request stream; every line logged meanwhile
carries it as ``x_request_id=``."""


class _KvFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{ts}.{int(record.msecs):03d} {record.levelname:<5} {record.name}: {record.getMessage()}"
        rid = REQUEST_ID.get()
        if rid is not None:
            line += f" x_request_id={rid}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        rid = REQUEST_ID.get()
        if rid is not None:
            obj["x_request_id"] = rid
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, separators=(",", ":"))


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record, not the object it was when
    logging was configured: a command run in-process (tests, an embedding program) may swap
    ``sys.stderr`` and close the old one, and a handler bound to that one would then fail on every
    record ("--- Logging error ---")."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure_logging(level: str | None = None, *, json_lines: bool | None = None, role: str = "") -> None:
    """Configures the root logger once per process (idempotent; later calls adjust the level)."""
    global _CONFIGURED
    level_name = (level or os.environ.get("DYN_LOG") or "info").upper()
    if level_name not in logging.getLevelNamesMapping():
        level_name = "INFO"
    root = logging.getLogger()
    root.setLevel(level_name)
    if _CONFIGURED:
        return
    if json_lines is None:
        json_lines = os.environ.get("DYN_LOGGING_JSONL", "").lower() in ("1", "true", "yes")
    handler = _StderrHandler()
    handler.setFormatter(_JsonFormatter() if json_lines else _KvFormatter())
    root.handlers[:] = [handler]
    # Third-party chatter stays at warning unless the operator asked for debug.
    for noisy in ("asyncio", "grpc", "nats", "uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING if level_name != "DEBUG" else logging.DEBUG)
    _CONFIGURED = True
