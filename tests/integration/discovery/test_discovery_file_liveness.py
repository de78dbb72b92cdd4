"""File discovery liveness with real owner processes: what a late, stopped, killed or clock-stepped
owner looks like to a reader in another process.

What a user relies on: a worker whose heartbeats are late (a CPU-starved or briefly stopped process)
is hidden while late but its entries are never deleted, so it comes back on its next beat without
re-registering; a forward wall-clock step deletes and hides nobody; a worker killed with -9 still
disappears within one lease TTL (plus a scan interval), and its files are collected.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from dynamod.shared.discovery.file import FileStore, encode_key
from dynamod.shared.discovery.file_liveness import LeaseJudge, OwnerState
from tests.integration.discovery.helpers_discovery import WatchRecorder, kill_and_reap

pytestmark = pytest.mark.timeout(120)

TTL = 1.0
SCAN_S = 0.2  # the store's default poll interval
KEY = "v1/instances/ns/backend/generate/abc"
PREFIX = "v1/instances/ns/"

# The owner: one lease, its keys, a heartbeat; SIGUSR1 steps its wall clock one hour forward.
OWNER_SCRIPT = r"""
import asyncio, logging, signal, sys, time
from dynamod.shared.discovery.file import FileStore

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
root, ttl, *pairs = sys.argv[1:]
real_time, offset = time.time, [0.0]
time.time = lambda: real_time() + offset[0]

async def main():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: offset.__setitem__(0, offset[0] + 3600.0))
    store = FileStore(root)
    await store.start()
    lease = await store.create_lease(float(ttl))
    for pair in pairs:
        key, _, value = pair.partition("=")
        await store.put(key, value.encode(), lease)
    print(f"READY {lease.id:x}", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await store.close()
    print("CLOSED", flush=True)

asyncio.run(main())
"""


class Owner:
    def __init__(self, root: str, log: Path, ttl: float, entries: dict[str, str]) -> None:
        self.args = [root, str(ttl), *(f"{k}={v}" for k, v in entries.items())]
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> Owner:
        with await asyncio.to_thread(self.log.open, "wb") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                OWNER_SCRIPT,
                *self.args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 20)
        assert line.startswith(b"READY "), (line, self.log_text())
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    async def cleanup(self) -> None:
        await kill_and_reap(self.proc)


@pytest.fixture
def root(tmp_path: Path) -> str:
    return str(tmp_path / "kv")


@pytest.fixture
async def owners(root: str, tmp_path: Path):
    started: list[Owner] = []

    async def spawn(ttl: float, entries: dict[str, str]) -> Owner:
        owner = Owner(root, tmp_path / f"owner{len(started)}.log", ttl, entries)
        started.append(owner)
        return await owner.start()

    yield spawn
    for owner in started:
        await owner.cleanup()


def reader(root: str, evidence: str) -> FileStore:
    """A reading store; ``evidence="none"`` makes it judge by the heartbeat counter alone, as it
    must for an owner in another pid namespace or without /proc."""
    judge = LeaseJudge() if evidence == "proc" else LeaseJudge(evidence=lambda _owner: OwnerState.UNKNOWN)
    return FileStore(root, judge=judge)


def key_version(root: str, key: str = KEY) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(root, "keys", encode_key(key)))
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


async def watched_owner(root: str, owners, evidence: str) -> tuple[FileStore, Owner, WatchRecorder]:
    """An owner registered with ``KEY`` (one-TTL lease), as a started reading store's watch sees it."""
    store = reader(root, evidence)
    await store.start()
    owner = await owners(TTL, {KEY: "worker-1"})
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: KEY in v, 2, "registration")
    return store, owner, watch


async def wait_until(predicate, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic()


@pytest.mark.parametrize("evidence", ["proc", "none"])
async def test_owner_late_by_one_and_a_half_ttl_is_hidden_but_never_deleted(
    root: str, owners, evidence: str
) -> None:
    store, owner, watch = await watched_owner(root, owners, evidence)
    before = key_version(root)
    assert before is not None

    owner.signal(signal.SIGSTOP)  # its heartbeats are late from now on
    stopped_at = time.monotonic()
    hidden_at = await watch.wait_for(lambda v: KEY not in v, TTL + 1.0, "late owner hidden")
    assert hidden_at - stopped_at >= TTL - SCAN_S  # not hidden before its TTL ran out
    while time.monotonic() - stopped_at < 1.5 * TTL:  # late the whole time: the files stay put
        assert key_version(root) == before, "a reader deleted a late owner's entry"
        assert os.listdir(os.path.join(root, "leases")), "a reader deleted a late owner's lease file"
        await asyncio.sleep(0.05)
    owner.signal(signal.SIGCONT)
    await watch.wait_for(lambda v: v.get(KEY) == b"worker-1", TTL, "owner visible on its next beat")
    assert key_version(root) == before  # same file: it never had to be put back
    assert "lease restored" not in owner.log_text()
    await watch.stop()
    await store.close()


@pytest.mark.parametrize("evidence", ["proc", "none"])
async def test_owner_stopped_long(root: str, owners, evidence: str) -> None:
    """Stopped for 3 TTLs: a reader that can see the process exists never deletes its entries; one
    that cannot collects them after twice the TTL, and the owner restores them when it resumes."""
    store, owner, watch = await watched_owner(root, owners, evidence)
    before = key_version(root)
    owner.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    if evidence == "proc":
        while time.monotonic() - stopped_at < 3 * TTL:
            assert key_version(root) == before, "a reader deleted the entry of a process that exists"
            await asyncio.sleep(0.05)
        assert KEY not in watch.view
    else:
        collected_at = await wait_until(lambda: key_version(root) is None, 2 * TTL + 1.5, "collection")
        assert collected_at - stopped_at > 2 * TTL - SCAN_S  # never before twice the TTL
        assert os.listdir(os.path.join(root, "leases")) == []
    owner.signal(signal.SIGCONT)
    await watch.wait_for(lambda v: v.get(KEY) == b"worker-1", TTL + 1.0, "owner back after SIGCONT")
    restored = "lease restored" in owner.log_text()
    assert restored is (evidence == "none"), owner.log_text()
    await watch.stop()
    await store.close()


async def test_wall_clock_step_forward_deletes_and_hides_nobody(root: str, owners, monkeypatch) -> None:
    """Both sides' wall clocks jump one hour forward (the owner's by SIGUSR1, this process's by
    patching time.time): the readers' watch sees no DELETE, no file is collected or restored."""
    ttl = 2.0  # a little slack for a loaded CI machine: this test is about the clock, not lateness
    store = FileStore(root)
    await store.start()
    owner = await owners(ttl, {KEY: "worker-1", KEY + "/card": "card"})
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: len(v) == 2, 2, "registration")
    before = key_version(root)
    events_before = len(watch.events)

    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)
    owner.signal(signal.SIGUSR1)
    stepped_at = time.monotonic()
    one_shot = FileStore(root)  # a reader born after the step (dynamoctl, the console)
    await one_shot.start()
    while time.monotonic() - stepped_at < 2.5 * ttl:
        assert await one_shot.get_prefix(PREFIX) == {KEY: b"worker-1", KEY + "/card": b"card"}
        assert key_version(root) == before
        await asyncio.sleep(0.1)
    await one_shot.close()
    assert [ev for _, ev in watch.events[events_before:]] == []  # neither hidden nor re-put
    assert "lease restored" not in owner.log_text()
    await watch.stop()
    await store.close()


@pytest.mark.parametrize("evidence", ["proc", "none"])
async def test_kill9_owner_disappears_within_one_ttl_and_is_collected(
    root: str, owners, evidence: str
) -> None:
    store = reader(root, evidence)
    await store.start()
    owner = await owners(TTL, {KEY: "worker-1", KEY + "/card": "card"})
    await store.put(PREFIX + "unleased", b"stays")
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: len(v) == 3, 2, "registration")

    owner.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    gone_at = await watch.wait_for(
        lambda v: KEY not in v and KEY + "/card" not in v, TTL + 2.0, "kill -9 owner gone"
    )
    assert gone_at - killed_at <= TTL + SCAN_S + 0.3
    # Its files are collected: at once when /proc shows the process gone, else after twice the TTL.
    limit = 1.0 if evidence == "proc" else 2 * TTL + 1.0
    await wait_until(
        lambda: os.listdir(os.path.join(root, "leases")) == [], limit, "dead lease file collected"
    )
    assert os.listdir(os.path.join(root, "keys")) == [encode_key(PREFIX + "unleased")]
    assert watch.view == {PREFIX + "unleased": b"stays"}
    await watch.stop()
    await store.close()


async def test_kill9_owner_is_not_listed_by_a_one_shot_reader(root: str, owners) -> None:
    """dynamoctl has no history: /proc tells it the owner is gone, so it does not list a ghost."""
    owner = await owners(30.0, {KEY: "worker-1"})
    owner.signal(signal.SIGKILL)
    assert owner.proc is not None
    await owner.proc.wait()
    one_shot = FileStore(root)
    await one_shot.start()
    assert await one_shot.get_prefix(PREFIX) == {}
    assert await one_shot.get(KEY) is None
    await one_shot.close()
