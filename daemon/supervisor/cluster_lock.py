"""One ``dynamod up`` per discovery directory (and per log directory).

Two ``up`` runs sharing the default discovery directory merged into one cluster without a word:
each frontend routed to both runs' workers, both wrote ``logs/frontend.log``, and both had a
``worker-0``, so one drain intent (kept under the worker's name) covered both. A second ``up`` now
stops before starting anything, naming the running one and the flag that separates them.

The lock is ``flock`` on a file beside the directory (not inside: the file backend reads every
file in its directory as a key), held for the life of ``up``. The kernel drops it when the process
ends however it ends, so a killed ``up`` leaves no stale lock; the file itself is left in place
(removing it could race a new ``up`` locking it). It holds the owner's pid and frontend address
for the refusal message.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from dynamod.shared.errors import ConfigError


def lock_path(directory: Path) -> Path:
    """``/tmp/dynamod-UID/discovery`` -> ``/tmp/dynamod-UID/discovery.up.lock``."""
    return directory.parent / f"{directory.name}.up.lock"


class ClusterLock:
    """Held while this ``up`` runs; ``acquire`` refuses when another process holds it."""

    def __init__(self, directory: Path, flag: str) -> None:
        self.directory = directory
        self.flag = flag  # the `up` flag that picks another directory, for the refusal message
        self.path = lock_path(directory)
        self._fd: int | None = None

    def acquire(self, owner: dict[str, object]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_owner(fd)
            os.close(fd)
            raise ConfigError(self._refusal(holder)) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), **owner}).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def _refusal(self, holder: dict[str, object]) -> str:
        who = f"pid {holder['pid']}" if "pid" in holder else "another process"
        url = f", frontend {holder['url']}" if holder.get("url") else ""
        return (
            f"another `dynamod up` ({who}{url}) is running with {self.directory}: a second one there would merge "
            f"with it (shared discovery, logs and worker names). Stop it first, or give this one its own "
            f"directory with {self.flag} DIR"
            + (" (and point dynamoctl and dynamo-console at it with --file-kv DIR)" if self.flag == "--file-kv" else "")
        )


def _read_owner(fd: int) -> dict[str, object]:
    try:
        value = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
