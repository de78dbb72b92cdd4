"""Event sequences: how a consumer notices that a source's numbered stream lost, repeated or restarted.

Three consumers read numbered streams and must tell these apart: the ZMQ event plane's subscriber
(frames carry ``seq``, from 1 per publisher), the native-engine subscriber (vLLM/SGLang batches,
from 0 per data-parallel rank) and the KV router (``RouterEvent.event_id``, from 0 per worker). A
consumer whose state is built from events must know when it missed some, so it can re-read the
source's state (``kv_dump``) instead of silently drifting. The bookkeeping is the same for all of
them and lives here once; what each does about a gap or a restart stays with the consumer.

What an id *below* the expected one means depends on the transport, so the source says:

- ``replays=False`` (the default): the transport never delivers older ids again, except the last
  one redelivered. Anything else going backwards means the source started its numbering over.
- ``replays=True``: a replay buffer may overlap the live stream, so older ids are duplicates; only
  the first id of a stream, seen again, means the source started over.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar


class Arrival(Enum):
    """How an observed id relates to its sequence."""

    IN_ORDER = "in_order"  # the expected id (or the first one of a stream joined late)
    DUPLICATE = "duplicate"  # seen already: skip it
    GAP = "gap"  # ids were skipped before it: what they carried is lost
    RESTART = "restart"  # the source started its numbering over


@dataclass(slots=True)
class SeqCounts:
    """Tallies over one sequence or many (a keyed container shares one), for logs and metrics."""

    gaps: int = 0  # discontinuities seen
    missed: int = 0  # ids known to be missing across all gaps
    duplicates: int = 0
    restarts: int = 0


class EventSequence:
    """One source's numbered stream: ``observe(n)`` classifies ``n`` and moves the position on.

    ``first`` is the id a stream starts at; None means the consumer joins late (the ZMQ slow-joiner
    window, a subscriber attached to a running publisher): whatever id comes first sets the
    baseline and nothing before it counts as lost.
    """

    __slots__ = ("_expected", "_last", "counts", "first", "replays")

    def __init__(
        self, first: int | None = 0, *, replays: bool = False, counts: SeqCounts | None = None
    ) -> None:
        if replays and first is None:
            raise ValueError("a replayed stream needs its first id: only that id marks a restart")
        self.first = first
        self.replays = replays
        self.counts = counts if counts is not None else SeqCounts()
        self._last: int | None = None
        self._expected: int | None = first

    @property
    def last(self) -> int | None:
        """The newest id taken (None before the first, or after ``rebase``)."""
        return self._last

    @property
    def expected(self) -> int | None:
        """The id that would arrive in order; None while any id would (a new baseline)."""
        return self._expected

    def observe(self, n: int) -> Arrival:
        """Classifies ``n``; every outcome but ``DUPLICATE`` makes ``n`` the newest id."""
        expected = self._expected
        if expected is None or n == expected:
            self._take(n)
            return Arrival.IN_ORDER
        if n > expected:
            self.counts.gaps += 1
            self.counts.missed += n - expected
            self._take(n)
            return Arrival.GAP
        repeated = n != self.first if self.replays else n == self._last
        if repeated:
            self.counts.duplicates += 1
            return Arrival.DUPLICATE
        self.counts.restarts += 1
        self._take(n)
        return Arrival.RESTART

    def resume_after(self, n: int) -> None:
        """Everything up to ``n`` reached the consumer another way (a dump): continue after it."""
        self._take(n)

    def rebase(self) -> None:
        """Nothing says where the source is (an empty dump): the next id, whatever it is, is in order."""
        self._last = None
        self._expected = None

    def _take(self, n: int) -> None:
        self._last = n
        self._expected = n + 1


K = TypeVar("K", bound=Hashable)


class EventSequences(Generic[K]):
    """One ``EventSequence`` per source (publisher, rank, worker), created on first use.

    The tallies are shared and outlive a forgotten source: a gap stays counted after its
    publisher went away.
    """

    def __init__(self, first: int | None = 0, *, replays: bool = False) -> None:
        if replays and first is None:
            raise ValueError("a replayed stream needs its first id: only that id marks a restart")
        self.first = first
        self.replays = replays
        self.counts = SeqCounts()
        self._by_source: dict[K, EventSequence] = {}

    def of(self, source: K) -> EventSequence:
        """The source's sequence (a new one, at ``first``, if it has none)."""
        seq = self._by_source.get(source)
        if seq is None:
            seq = self._by_source[source] = EventSequence(
                self.first, replays=self.replays, counts=self.counts
            )
        return seq

    def observe(self, source: K, n: int) -> Arrival:
        return self.of(source).observe(n)

    def last(self, source: K) -> int | None:
        seq = self._by_source.get(source)
        return None if seq is None else seq.last

    def forget(self, source: K) -> None:
        """Drops a source (it went away); if it comes back it starts a new sequence."""
        self._by_source.pop(source, None)

    def __contains__(self, source: object) -> bool:
        return source in self._by_source

    def __len__(self) -> int:
        return len(self._by_source)
