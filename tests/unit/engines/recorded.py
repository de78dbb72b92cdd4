"""Loads the recorded engine payloads in tests/fixtures/recorded (see its README)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).resolve().parents[2] / "fixtures" / "recorded"


def load(name: str) -> dict[str, Any]:
    return json.loads((RECORDED / name).read_text())


def frames(doc: dict[str, Any], key: str = "frames") -> list[list[bytes]]:
    """Base64 multipart ZMQ messages as bytes."""
    return [[base64.b64decode(part) for part in message] for message in doc[key]]
