"""Stop strings over a stream of text deltas.

A stop string can arrive split across deltas ("Obs" + "ervation:"), so text that might be the
start of a stop is held back until the next delta decides it. Only the longest suffix that is a
proper prefix of some stop is held; everything before it is safe to emit at once.

When several stops occur, the one that is complete first in the text wins (earliest end; at equal
ends, the longer one). That is what a stream can decide without looking ahead, and it makes the
result independent of how the text was split into deltas.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Per-request stop-string state. ``feed`` deltas; ``flush`` at the end of generation."""

    def __init__(self, stops: Iterable[str], *, include_stop_str_in_output: bool = False) -> None:
        """Empty strings in ``stops`` are ignored (they would match before any text)."""
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._include_stop = include_stop_str_in_output
        self._held = ""
        self._matched: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    @property
    def held_text(self) -> str:
        """Text held back because it may begin a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched or None).

        After a match the text ends: the emitted text stops before the stop string (or includes it
        when asked) and later calls return ``("", None)``.
        """
        if self._matched is not None:
            return "", None
        if not self._stops:
            return delta, None
        buffer = self._held + delta
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._matched = stop
            self._held = ""
            end = start + len(stop) if self._include_stop else start
            return buffer[:end], stop
        hold = self._partial_stop_suffix_len(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """Returns the held-back text: generation ended, so it cannot become a stop any more."""
        held, self._held = self._held, ""
        return "" if self._matched is not None else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _partial_stop_suffix_len(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
