"""Per-publisher sequence tracking: what a subscriber reports as lost."""

from __future__ import annotations

from dynamod.shared.events.seq import SeqTracker


def test_consecutive_sequences_have_no_gaps() -> None:
    t = SeqTracker()
    assert [t.observe("a", s) for s in (1, 2, 3)] == [0, 0, 0]
    assert t.gaps == 0 and t.missed == 0


def test_first_message_sets_the_baseline() -> None:
    # Joining late (or the ZMQ slow-joiner window) is not a gap: nothing before was promised.
    t = SeqTracker()
    assert t.observe("a", 17) == 0
    assert t.gaps == 0 and t.last("a") == 17


def test_holes_are_counted_per_source() -> None:
    t = SeqTracker()
    for s in (1, 2, 5):
        t.observe("a", s)
    for s in (1, 3, 4, 10):
        t.observe("b", s)
    assert t.gaps == 3  # a: 3-4; b: 2, 5-9
    assert t.missed == 2 + 1 + 5


def test_a_restarted_counter_is_a_reset_not_a_gap() -> None:
    t = SeqTracker()
    for s in (1, 2, 3):
        t.observe("a", s)
    assert t.observe("a", 1) == 0
    assert t.resets == 1 and t.gaps == 0
    assert t.observe("a", 2) == 0


def test_forgotten_source_starts_a_new_baseline() -> None:
    t = SeqTracker()
    t.observe("a", 1)
    t.forget("a")
    assert t.observe("a", 50) == 0
    assert t.gaps == 0
