"""Event sequences: what a consumer of a numbered stream reports as lost, repeated or restarted."""

from __future__ import annotations

import pytest

from dynamod.shared.events.seq import Arrival, EventSequence, EventSequences

IN_ORDER, DUPLICATE, GAP, RESTART = Arrival.IN_ORDER, Arrival.DUPLICATE, Arrival.GAP, Arrival.RESTART


def test_consecutive_sequences_have_no_gaps() -> None:
    t: EventSequences[str] = EventSequences(first=None)
    assert [t.observe("a", s) for s in (1, 2, 3)] == [IN_ORDER] * 3
    assert t.counts.gaps == 0 and t.counts.missed == 0


def test_first_message_sets_the_baseline_when_joining_late() -> None:
    # Joining late (or the ZMQ slow-joiner window) is not a gap: nothing before was promised.
    t: EventSequences[str] = EventSequences(first=None)
    assert t.observe("a", 17) is IN_ORDER
    assert t.counts.gaps == 0 and t.last("a") == 17


def test_holes_are_counted_per_source() -> None:
    t: EventSequences[str] = EventSequences(first=None)
    for s in (1, 2, 5):
        t.observe("a", s)
    assert [t.observe("b", s) for s in (1, 3, 4, 10)] == [IN_ORDER, GAP, IN_ORDER, GAP]
    assert t.counts.gaps == 3  # a: 3-4; b: 2, 5-9
    assert t.counts.missed == 2 + 1 + 5


def test_a_restarted_counter_is_a_restart_not_a_gap() -> None:
    t: EventSequences[str] = EventSequences(first=None)
    for s in (1, 2, 3):
        t.observe("a", s)
    assert t.observe("a", 1) is RESTART
    assert t.counts.restarts == 1 and t.counts.gaps == 0
    assert t.observe("a", 2) is IN_ORDER


def test_forgotten_source_starts_a_new_baseline_and_its_counts_stay() -> None:
    t: EventSequences[str] = EventSequences(first=None)
    t.observe("a", 1)
    t.observe("a", 3)
    t.forget("a")
    assert "a" not in t and t.last("a") is None
    assert t.observe("a", 50) is IN_ORDER
    assert t.counts.gaps == 1 and t.counts.missed == 1


def test_a_stream_with_a_first_id_misses_what_came_before_its_first_event() -> None:
    # The router's view of a worker: events are numbered from 0, so a first event 42 lost 0..41.
    s = EventSequence(first=0)
    assert s.observe(42) is GAP and s.counts.missed == 42
    assert EventSequence(first=0).observe(0) is IN_ORDER


def test_without_replays_only_the_last_id_repeats_and_other_older_ids_are_a_restart() -> None:
    s = EventSequence(first=0)
    for n in range(5):
        s.observe(n)
    assert s.observe(4) is DUPLICATE and s.last == 4  # redelivered: the position stays
    assert s.observe(2) is RESTART and s.last == 2  # a restarted worker whose first events were lost
    assert s.observe(3) is IN_ORDER
    assert s.observe(0) is RESTART
    assert (s.counts.duplicates, s.counts.restarts, s.counts.gaps) == (1, 2, 0)


def test_with_replays_older_ids_are_duplicates_and_only_the_first_id_is_a_restart() -> None:
    # The native-engine subscriber: a replay buffer may overlap the live stream.
    s = EventSequence(first=0, replays=True)
    for n in range(5):
        s.observe(n)
    assert s.observe(2) is DUPLICATE and s.last == 4
    assert s.observe(4) is DUPLICATE
    assert s.observe(0) is RESTART and s.expected == 1
    assert (s.counts.duplicates, s.counts.restarts) == (2, 1)


def test_a_replayed_stream_needs_its_first_id() -> None:
    with pytest.raises(ValueError):
        EventSequence(first=None, replays=True)
    with pytest.raises(ValueError):
        EventSequences(first=None, replays=True)


def test_resume_after_a_dump_and_rebase_without_one() -> None:
    s = EventSequence(first=0)
    s.observe(0)
    s.resume_after(9)  # a dump covered everything up to 9
    assert s.last == 9 and s.observe(10) is IN_ORDER
    s.rebase()  # an empty dump: nothing says where the source is
    assert s.last is None and s.expected is None
    assert s.observe(57) is IN_ORDER and s.observe(59) is GAP


def test_sequences_of_one_container_share_their_counts() -> None:
    t: EventSequences[int] = EventSequences(first=0)
    t.observe(1, 1)
    t.observe(2, 3)
    assert t.of(1).counts is t.counts and len(t) == 2
    assert t.counts.gaps == 2 and t.counts.missed == 1 + 3
