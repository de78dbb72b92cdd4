"""The one printed form of a worker (instance) id: lowercase hex, zero-padded to 16 characters.

Instance ids are 64-bit (discovery lease ids), so every id prints as exactly 16 hex digits, without
``0x``: an id that happens to start with a 0 nibble lines up with the others instead of showing
as 15 characters beside 16. Headers (``x-dynamo-worker-instance-id``), ``x-dynamo-route-explain``,
logs, the console and ``dynamoctl`` all use ``worker_id_hex``; readers accept it with or without
the padding (``int(text, 16)``).
"""

from __future__ import annotations

import functools

WORKER_ID_HEX_WIDTH = 16


@functools.lru_cache(maxsize=4096)
def worker_id_hex(instance_id: int) -> str:
    """``instance_id`` as 16 lowercase hex digits (wider only for an id beyond 64 bits). Cached:
    a fleet has few ids and formatting one costs more than a lookup, and a traced request names
    its worker several times on the frontend's path."""
    return f"{instance_id:0{WORKER_ID_HEX_WIDTH}x}"


def worker_id_or_dash(instance_id: int | None) -> str:
    """``worker_id_hex``, or ``-`` where there is no worker (a table cell, a log field)."""
    return "-" if instance_id is None else worker_id_hex(instance_id)
