"""Per-publisher sequence tracking: how a subscriber notices that it lost events.

ZMQ frames carry ``seq`` (u64, starting at 1 per publisher). A consumer whose state is built from
events (the KV router's index) must know when it missed some, so it can re-read that publisher's
state (``kv_dump``) instead of silently drifting. This class keeps the bookkeeping in one place.
"""

from __future__ import annotations

from collections.abc import Hashable


class SeqTracker:
    """Counts gaps per source. The first message seen from a source sets its baseline: whatever
    came before it (joining late, the ZMQ slow-joiner window) is not counted as a gap."""

    def __init__(self) -> None:
        self._last: dict[Hashable, int] = {}
        self.gaps = 0  # discontinuities seen
        self.missed = 0  # messages known to be missing across all gaps
        self.resets = 0  # a source's seq went backwards: it restarted its counter

    def observe(self, source: Hashable, seq: int) -> int:
        """Records ``seq`` from ``source``; returns how many messages are missing right before it."""
        last = self._last.get(source)
        self._last[source] = seq
        if last is None or seq == last + 1:
            return 0
        if seq <= last:
            self.resets += 1
            return 0
        missing = seq - last - 1
        self.gaps += 1
        self.missed += missing
        return missing

    def last(self, source: Hashable) -> int | None:
        return self._last.get(source)

    def forget(self, source: Hashable) -> None:
        """Drops a source (its publisher went away); if it comes back it starts a new baseline."""
        self._last.pop(source, None)
