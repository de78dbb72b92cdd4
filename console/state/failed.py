"""Workers ``dynamod up`` gave up on: the supervisor's ``v1/supervisor/{ns}/failed/{name}`` records.

A worker in a crash loop has no process and so no instance record: without these it would simply
vanish from the console and ``dynamoctl status`` while its pool serves on short of it (issue 24
item 6). Each record names the worker, its pool, its last death and its log; it is deleted when
``dynamoctl restart NAME`` starts the worker again. A failure and a restart are one event each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dynamod.console.state.event_log import EventLog
from dynamod.console.state.records import EV_ERROR, EV_REGISTERED
from dynamod.console.state.versions import Versions
from dynamod.shared.protocol.supervisor import SUPERVISOR_ROOT, FailedWorker

STATUS_FAILED = "failed"


def parse_failed_key(key: str) -> tuple[str, str] | None:
    """(namespace, worker name) of a ``v1/supervisor/{ns}/failed/{name}`` key; None for any other
    key under the supervisor root (restart requests)."""
    if not key.startswith(SUPERVISOR_ROOT):
        return None
    parts = key[len(SUPERVISOR_ROOT):].split("/")
    if len(parts) != 3 or parts[1] != "failed" or not parts[0] or not parts[2]:
        return None
    return parts[0], parts[2]


@dataclass(slots=True)
class FailedEntry:
    namespace: str
    record: FailedWorker

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def pool(self) -> str:
        return self.record.pool or "agg"

    def summary(self) -> str:
        """``exit code 1 (3 deaths in 60s)``: what the Workers banner and tables show."""
        r = self.record
        deaths = f" ({r.crashes} deaths in {r.window_s:g}s)" if r.crashes else ""
        return f"{r.reason or 'died'}{deaths}"


class FailedWorkers:
    """The failed records by discovery key (only ``.../failed/...`` keys are kept)."""

    def __init__(self, versions: Versions, log: EventLog) -> None:
        self._versions = versions
        self._log = log
        self.entries: dict[str, FailedEntry] = {}

    def put(self, key: str, record: FailedWorker) -> None:
        parsed = parse_failed_key(key)
        if parsed is None:
            return
        old = self.entries.get(key)
        if old is not None and old.record == record:
            return
        entry = self.entries[key] = FailedEntry(parsed[0], record)
        self._versions.topology += 1
        if old is None:
            self._log.add(
                EV_ERROR,
                f"{entry.name} failed: {entry.summary()}; not restarted (crash loop): `dynamoctl restart {entry.name}`",
                namespace=entry.namespace,
                component=entry.pool,
                severity="error",
            )

    def delete(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self._versions.topology += 1
        self._log.add(EV_REGISTERED, f"{entry.name} is no longer failed: restarted by request",
                      namespace=entry.namespace, component=entry.pool)

    def reconcile(self, live: Mapping[str, FailedWorker]) -> None:
        for key, record in live.items():
            self.put(key, record)
        for key in [k for k in self.entries if k not in live]:
            self.delete(key)

    def listed(self, namespace: str | None = None) -> list[FailedEntry]:
        """By namespace then name (``namespace`` None: all)."""
        out = [e for e in self.entries.values() if namespace is None or e.namespace == namespace]
        out.sort(key=lambda e: (e.namespace, e.name))
        return out
