"""The console's own connections (discovery, event plane): their state, and events on change.

Collectors report every attempt; an operator wants to hear once that a connection was lost and once
that it came back, so only transitions become events while repeats just refresh the detail.
"""

from __future__ import annotations

from collections.abc import Callable

from dynamod.console.state.event_log import EventLog
from dynamod.console.state.records import EV_CONNECTION, ConnectionStatus
from dynamod.console.state.versions import Versions


class ConnectionTracker:
    """``ConnectionStatus`` by connection name."""

    def __init__(self, clock: Callable[[], float], versions: Versions, log: EventLog) -> None:
        self._clock = clock
        self._versions = versions
        self._log = log
        self.connections: dict[str, ConnectionStatus] = {}

    def set(self, name: str, state: str, target: str = "", detail: str = "") -> None:
        """``state`` is connecting | ok | lost. Transitions become events; repeats are silent."""
        conn = self.connections.get(name)
        if conn is None:
            conn = self.connections[name] = ConnectionStatus(name, target, "connecting", "", self._clock())
        if target:
            conn.target = target
        changed = conn.state != state
        conn.detail = detail
        if changed:
            previous = conn.state
            conn.state = state
            conn.since = self._clock()
            if state == "lost":
                self._log.add(EV_CONNECTION, f"{name} connection lost ({conn.target}): {detail}", severity="error")
            elif state == "ok" and previous == "lost":
                self._log.add(EV_CONNECTION, f"{name} connection recovered ({conn.target})")
            elif state == "ok":
                self._log.add(EV_CONNECTION, f"{name} connected ({conn.target})")
        self._versions.connection += 1
