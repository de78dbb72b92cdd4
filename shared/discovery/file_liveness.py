"""Whether a file-discovery lease is alive, judged by each reader on its OWN monotonic clock.

The owner of a lease rewrites its lease file every ``ttl/3`` with a heartbeat counter one higher
(``beat``). A reader remembers, per lease, the last counter it saw and the time *on its own
monotonic clock* at which it saw it change; the wall clock and file mtimes are never compared with
anything, so a wall-clock step (NTP, a VM resumed) or a coarse mtime cannot make a live owner look
dead, and a reader that was itself paused does not kill anybody either (on resume the counters have
moved). The verdicts:

* ``ALIVE``: the counter moved within the TTL (a lease seen for the first time gets a full TTL
  before it is judged), or the lease is the reader's own.
* ``LATE``: the counter has not moved for more than one TTL. Its entries are hidden from readers
  (like an expired etcd lease: nobody should route to a process that stopped beating) but their
  files are left alone; the owner's next beat makes them visible again, without re-putting anything.
* ``DEAD``: the entries may be garbage-collected. Either the owner process is provably gone (see
  below), or nothing is known about it and its counter has not moved for more than twice the TTL.
  The collector re-checks that the lease file is unchanged just before deleting anything.

Owner evidence: the lease file also names its owner (pid, process start time, boot id, pid
namespace). A reader on the same boot and in the same pid namespace can tell from ``/proc`` whether
that process still exists: if it does not (or the pid now belongs to a process started later, or
is a zombie) the lease is ``DEAD`` at once, so a process killed with -9 disappears at the reader's
next scan, even for a one-shot reader (dynamoctl) that has no history; a lease written before the
last reboot is ``DEAD`` too. If the process does exist (stopped, hung, starved of CPU) its entries
are hidden while it is late but never deleted: it may resume at any time. Without evidence (another
pid namespace, no ``/proc``, a lease file written by an older dynamod) only the counter counts.
"""

from __future__ import annotations

import enum
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Marker of progress: the heartbeat counter, or the mtime for lease files without one (older
# owners that only touch the file). Only equality is ever used.
Marker = int
Signature = tuple[int, int, int]  # (inode, mtime_ns, size): the owner's atomic rewrite changes it

_ORPHAN_MEMORY_S = 3600.0


class Verdict(enum.Enum):
    ALIVE = "alive"
    LATE = "late"
    DEAD = "dead"


class OwnerState(enum.Enum):
    EXISTS = "exists"
    GONE = "gone"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class OwnerIdentity:
    """The process that owns a lease, as written in its lease file."""

    pid: int
    host: str
    boot: str  # /proc/sys/kernel/random/boot_id, "" if unknown
    pidns: str  # readlink /proc/self/ns/pid, "" if unknown
    start: int  # process start time in clock ticks since boot (/proc/<pid>/stat field 22), 0 if unknown

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "host": self.host,
            "boot": self.boot,
            "pidns": self.pidns,
            "start": self.start,
        }

    @staticmethod
    def from_json(body: dict[str, Any]) -> OwnerIdentity | None:
        try:
            return OwnerIdentity(
                int(body["pid"]), str(body["host"]), str(body["boot"]), str(body["pidns"]), int(body["start"])
            )
        except (KeyError, TypeError, ValueError):
            return None  # an older lease file: no evidence


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start ticks) of ``pid``, or None if there is no such process."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


@functools.cache
def _this_process_cached(pid: int) -> OwnerIdentity:
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    stat = _proc_stat(pid)
    return OwnerIdentity(
        pid, socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), pidns, stat[1] if stat else 0
    )


def this_process() -> OwnerIdentity:
    return _this_process_cached(os.getpid())  # keyed by pid: a forked child is another owner


def owner_state(owner: OwnerIdentity | None) -> OwnerState:
    """What this host's ``/proc`` says about ``owner`` (UNKNOWN whenever it cannot say)."""
    me = this_process()
    if owner is None or not owner.boot or not me.boot or owner.host != me.host:
        return OwnerState.UNKNOWN
    if owner.boot != me.boot:
        return OwnerState.GONE  # written before this host's last reboot
    if not owner.pidns or owner.pidns != me.pidns or not owner.start:
        return OwnerState.UNKNOWN
    stat = _proc_stat(owner.pid)
    if stat is None or stat[0] in ("Z", "X") or stat[1] != owner.start:
        return OwnerState.GONE  # no such process, a zombie, or the pid was reused
    return OwnerState.EXISTS


@dataclass(slots=True)
class _Seen:
    ttl_s: float
    signature: Signature
    marker: Marker
    owner: OwnerIdentity | None
    changed_at: float
    reaped: bool = False


class LeaseJudge:
    """One reader's memory of every lease it has seen (one per FileStore, shared by its scans).

    Callers hold ``lock`` around a pass over the lease directory; scans run in worker threads.
    ``clock`` is monotonic (injectable for tests); ``evidence`` tells what is known of an owner.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        evidence: Callable[[OwnerIdentity | None], OwnerState] = owner_state,
    ) -> None:
        self.clock = clock
        self.evidence = evidence
        self.lock = threading.Lock()
        self._seen: dict[int, _Seen] = {}
        self._gone_ttl: dict[int, float] = {}  # TTL of leases whose file disappeared
        # lease id -> when its entries were first seen without a lease file
        self._orphans: dict[int, float] = {}
        self._tmp: dict[str, float] = {}  # temp file -> when first seen

    def signature(self, lease_id: int) -> Signature | None:
        seen = self._seen.get(lease_id)
        return seen.signature if seen else None

    def judge(
        self,
        lease_id: int,
        ttl_s: float,
        signature: Signature,
        read: Callable[[], tuple[Marker, OwnerIdentity | None] | None],
        now: float,
    ) -> Verdict | None:
        """The verdict on one lease file; ``read`` (called only if the file changed since the last
        look) gives its marker and owner, or None if it vanished (then so does the verdict)."""
        seen = self._seen.get(lease_id)
        first = seen is None
        if seen is None or seen.signature != signature:
            got = read()
            if got is None:
                return None
            marker, owner = got
            if seen is None:  # first sight: a full TTL from now
                seen = self._seen[lease_id] = _Seen(ttl_s, signature, marker, owner, now)
                self._orphans.pop(lease_id, None)
            else:
                seen.signature = signature
                seen.owner = owner or seen.owner
                if marker != seen.marker:
                    seen.marker, seen.changed_at, seen.reaped = marker, now, False
        late_by = now - seen.changed_at
        # Ask /proc only when it can change the answer: a new lease, or a beat overdue.
        if first or late_by > seen.ttl_s / 3:
            state = self.evidence(seen.owner)
            if state is OwnerState.GONE:
                return Verdict.DEAD
        else:
            state = OwnerState.UNKNOWN
        if late_by <= seen.ttl_s:
            return Verdict.ALIVE
        if state is OwnerState.EXISTS or late_by <= 2 * seen.ttl_s:
            return Verdict.LATE
        return Verdict.DEAD

    def claim_reap(self, lease_id: int) -> bool:
        """True once per death of a lease, so that several scans of one store do not all collect it."""
        seen = self._seen.get(lease_id)
        if seen is None or seen.reaped:
            return False
        seen.reaped = True
        return True

    def forget_missing(self, present: set[int], now: float) -> None:
        """Drops leases whose files are gone (remembering their TTL for orphan entries)."""
        for lease_id in [i for i in self._seen if i not in present]:
            self._gone_ttl[lease_id] = self._seen.pop(lease_id).ttl_s
        for table in (self._orphans, self._tmp):
            for k in [k for k, t in table.items() if now - t > _ORPHAN_MEMORY_S]:
                del table[k]
        if len(self._gone_ttl) > 10_000:
            self._gone_ttl.clear()

    def orphan_expired(self, lease_id: int, default_ttl_s: float, now: float) -> bool:
        """Entries whose lease file is missing: hidden at once, collectable after twice the TTL
        (an owner that is alive re-creates its lease file and keys on its next beat)."""
        first = self._orphans.setdefault(lease_id, now)
        return now - first > 2 * self._gone_ttl.get(lease_id, default_ttl_s)

    def tmp_expired(self, name: str, max_age_s: float, now: float) -> bool:
        """A temp file this reader has seen for ``max_age_s``: left behind by a crashed writer."""
        return now - self._tmp.setdefault(name, now) > max_age_s
