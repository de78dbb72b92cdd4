"""Process logging: one line per event, ``key=value`` fields, level from ``DYN_LOG``.

``DYN_LOG`` takes a level name (``debug``, ``info``, ``warning``, ``error``); ``DYN_LOGGING_JSONL=1``
switches to one JSON object per line for log shippers. Messages are written as
``"event key=value key=value"`` by the callers; this module only frames them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_CONFIGURED = False


class _KvFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{ts}.{int(record.msecs):03d} {record.levelname:<5} {record.name}: {record.getMessage()}"
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
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, separators=(",", ":"))


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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_lines else _KvFormatter())
    root.handlers[:] = [handler]
    # Third-party chatter stays at warning unless the operator asked for debug.
    for noisy in ("asyncio", "grpc", "nats", "uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING if level_name != "DEBUG" else logging.DEBUG)
    _CONFIGURED = True
