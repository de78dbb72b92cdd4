"""The lease judge of file discovery on an injected monotonic clock: how long a silent owner stays
visible, when it is hidden, and when (if ever) its entries may be collected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynamod.shared.discovery.file_liveness import (
    LeaseJudge,
    OwnerIdentity,
    OwnerState,
    Verdict,
    owner_state,
    this_process,
)

TTL = 3.0
OWNER = OwnerIdentity(pid=1234, host="h", boot="b", pidns="ns", start=1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lease:
    """A lease file as a reader sees it: a signature that changes on every beat, and a counter."""

    def __init__(self, judge: LeaseJudge, clock: Clock) -> None:
        self.judge, self.clock = judge, clock
        self.beat = 0

    def tick(self) -> None:
        self.beat += 1

    def verdict(self) -> Verdict | None:
        sig = (self.beat, self.beat, 10)
        return self.judge.judge(7, TTL, sig, lambda: (self.beat, OWNER), self.clock())


def make(state: OwnerState = OwnerState.UNKNOWN) -> tuple[Lease, Clock]:
    clock = Clock()
    return Lease(LeaseJudge(clock, evidence=lambda _owner: state), clock), clock


def test_first_sight_gets_a_full_ttl_even_if_the_counter_never_moves() -> None:
    lease, clock = make()
    assert lease.verdict() is Verdict.ALIVE
    clock.now += TTL
    assert lease.verdict() is Verdict.ALIVE
    clock.now += 0.01
    assert lease.verdict() is Verdict.LATE


def test_a_beating_owner_stays_alive_forever() -> None:
    lease, clock = make()
    for _ in range(100):
        clock.now += TTL / 3
        lease.tick()
        assert lease.verdict() is Verdict.ALIVE


def test_silent_owner_without_evidence_is_hidden_after_one_ttl_and_collectable_after_two() -> None:
    lease, clock = make()
    lease.verdict()
    clock.now += 1.5 * TTL
    assert lease.verdict() is Verdict.LATE
    lease.tick()  # it beats again: visible at once
    assert lease.verdict() is Verdict.ALIVE
    clock.now += 2 * TTL + 0.01
    assert lease.verdict() is Verdict.DEAD
    assert lease.judge.claim_reap(7) and not lease.judge.claim_reap(7)  # collected once per death
    lease.tick()  # back from the dead (an owner restoring its lease): a later death is collected again
    assert lease.verdict() is Verdict.ALIVE
    clock.now += 2 * TTL + 0.01
    assert lease.verdict() is Verdict.DEAD and lease.judge.claim_reap(7)


def test_an_owner_that_exists_is_never_collected_and_a_gone_one_at_once() -> None:
    lease, clock = make(OwnerState.EXISTS)
    lease.verdict()
    clock.now += 100 * TTL
    assert lease.verdict() is Verdict.LATE
    gone, _ = make(OwnerState.GONE)
    assert gone.verdict() is Verdict.DEAD


def test_the_counter_not_the_signature_is_progress() -> None:
    """A rewrite with the same counter (e.g. a restore without a beat) is not a heartbeat."""
    clock = Clock()
    judge = LeaseJudge(clock, evidence=lambda _o: OwnerState.UNKNOWN)
    judge.judge(7, TTL, (1, 1, 1), lambda: (5, OWNER), clock())
    clock.now += 1.5 * TTL
    assert judge.judge(7, TTL, (2, 2, 2), lambda: (5, OWNER), clock()) is Verdict.LATE
    assert judge.judge(7, TTL, (3, 3, 3), lambda: (6, OWNER), clock()) is Verdict.ALIVE


def test_a_lease_file_that_vanished_while_read_gives_no_verdict() -> None:
    clock = Clock()
    judge = LeaseJudge(clock)
    assert judge.judge(7, TTL, (1, 1, 1), lambda: None, clock()) is None


def test_orphan_entries_are_collectable_after_twice_the_last_known_ttl() -> None:
    lease, clock = make()
    lease.verdict()
    lease.judge.forget_missing(set(), clock())  # its lease file disappeared
    assert not lease.judge.orphan_expired(7, 10.0, clock())
    clock.now += 2 * TTL - 0.1
    assert not lease.judge.orphan_expired(7, 10.0, clock())
    clock.now += 0.2
    assert lease.judge.orphan_expired(7, 10.0, clock())


def test_owner_evidence_from_proc() -> None:
    me = this_process()
    assert me.pid == os.getpid() and me.host
    if not me.boot or not me.pidns or not me.start:
        pytest.skip("no /proc evidence on this platform")
    assert owner_state(me) is OwnerState.EXISTS
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = OwnerIdentity(child.pid, me.host, me.boot, me.pidns, me.start)
    assert owner_state(dead) is OwnerState.GONE  # no such process (or a reused pid: other start time)
    assert owner_state(OwnerIdentity(me.pid, me.host, me.boot, me.pidns, me.start + 1)) is OwnerState.GONE
    assert owner_state(OwnerIdentity(me.pid, me.host, "another-boot", me.pidns, me.start)) is OwnerState.GONE
    assert owner_state(OwnerIdentity(me.pid, "other-host", "x", me.pidns, me.start)) is OwnerState.UNKNOWN
    assert owner_state(OwnerIdentity(1, me.host, me.boot, "pid:[1]", 5)) is OwnerState.UNKNOWN
    assert owner_state(None) is OwnerState.UNKNOWN
