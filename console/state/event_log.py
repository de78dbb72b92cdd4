"""The operator-facing event log: what happened in the cluster, newest last, bounded.

Every other part of the state writes here (registrations, drains, LoRA loads, imbalances,
connection changes); the Events view and ``dynamoctl watch`` read it. Two kinds of entry have their
own shape and so their own method: the result of an operator's action, and a message the console
could not read, which is counted every time but shown once per source per minute so one broken
publisher cannot flood the log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from dynamod.console.state.records import EV_ACTION, EV_ERROR, ClusterEvent
from dynamod.console.state.versions import Versions

MAX_EVENTS = 2000
DECODE_ERROR_REPEAT_S = 60.0

EventListener = Callable[[ClusterEvent], None]


class EventSubject(Protocol):
    """Anything an event can be about: a worker, an imbalance found on one."""

    @property
    def namespace(self) -> str: ...

    @property
    def component(self) -> str: ...

    @property
    def instance_id(self) -> int: ...


def _as_id(value: Any) -> int | None:
    """Ids arrive as ints (msgpack) or hex strings (JSON, labels)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value:
        try:
            return int(value[2:] if value.lower().startswith("0x") else value, 16)
        except ValueError:
            return None
    return None


class EventLog:
    """The last ``maxlen`` events and the listeners told of each new one as it is added."""

    def __init__(self, clock: Callable[[], float], versions: Versions, maxlen: int = MAX_EVENTS) -> None:
        self._clock = clock
        self._versions = versions
        self.events: deque[ClusterEvent] = deque(maxlen=maxlen)
        self.decode_errors = 0
        self._listeners: list[EventListener] = []
        self._error_shown_at: dict[str, float] = {}

    def add_listener(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    def add(
        self,
        kind: str,
        message: str,
        *,
        namespace: str = "",
        component: str = "",
        instance_id: int | None = None,
        severity: str = "info",
    ) -> ClusterEvent:
        ev = ClusterEvent(self._clock(), kind, message, namespace, component, instance_id, severity)
        self.events.append(ev)
        self._versions.events += 1
        for listener in self._listeners:
            listener(ev)
        return ev

    def add_about(self, about: EventSubject, kind: str, message: str, *, severity: str = "info") -> ClusterEvent:
        """An event about one instance (its namespace, component and id)."""
        return self.add(
            kind,
            message,
            namespace=about.namespace,
            component=about.component,
            instance_id=about.instance_id,
            severity=severity,
        )

    def recent(self, needle: str = "", kinds: Iterable[str] | None = None, limit: int | None = None) -> list[ClusterEvent]:
        """Newest first, optionally filtered by a text needle and a set of kinds."""
        wanted = set(kinds) if kinds else None
        out: list[ClusterEvent] = []
        for ev in reversed(self.events):
            if wanted is not None and ev.kind not in wanted:
                continue
            if ev.matches(needle):
                out.append(ev)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def record_action(self, action: str, target: str, ok: bool, message: str) -> ClusterEvent:
        """An operator's action and its result; ``target`` ends in the instance id it acted on."""
        iid = _as_id(target.rsplit("/", 1)[-1])
        return self.add(
            EV_ACTION,
            f"{action} {target}: {'ok' if ok else 'failed'}: {message}",
            instance_id=iid,
            severity="info" if ok else "error",
        )

    def note_decode_error(self, source: str, detail: str) -> None:
        """A message that could not be read. Counted always, shown once per source per minute."""
        self.decode_errors += 1
        now = self._clock()
        last = self._error_shown_at.get(source)
        if last is None or now - last >= DECODE_ERROR_REPEAT_S:
            self._error_shown_at[source] = now
            self.add(EV_ERROR, f"unreadable {source} message: {detail}", severity="error")
