"""File discovery shared by real processes on one host, and the factory defaults that find it.

What a user relies on: `dynamod up`'s processes find each other through the directory; a process
killed with -9 disappears within its lease TTL; a clean shutdown disappears at once; a process that
was stopped past its TTL comes back by itself; keys without a lease persist.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time

import pytest

from dynamod.shared.discovery.factory import BACKENDS, default_file_kv_dir, make_store
from dynamod.shared.discovery.file import FileStore, decode_key, encode_key
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.errors import ConfigError, DiscoveryError
from tests.integration.discovery.helpers_discovery import Registrars, WatchRecorder, check_close_removes_keys

TTL = 1.0
KEY = "v1/instances/ns/backend/generate/abc"
PREFIX = "v1/instances/ns/"


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "kv")


@pytest.fixture
async def store(root: str):
    s = FileStore(root)
    await s.start()
    yield s
    await s.close()


@pytest.fixture
async def children(root: str):
    registrars = Registrars("file")
    yield functools.partial(registrars.spawn, root)
    await registrars.cleanup()


# -- one process ------------------------------------------------------------------------------


def test_key_names_are_safe_reversible_and_prefix_preserving() -> None:
    for key in ("v1/instances/ns/c/e/1a", "a b/ü/%/..", "-_x", "../../etc/passwd"):
        name = encode_key(key)
        assert "/" not in name and not name.startswith(".")
        assert decode_key(name) == key
    assert encode_key("v1/instances/ns/x").startswith(encode_key("v1/instances/"))
    long_name = encode_key("v1/" + "k" * 400)
    assert len(long_name) < 255 and decode_key(long_name) is None


async def test_store_basics_and_unleased_keys(store: FileStore, root: str) -> None:
    assert isinstance(store, DiscoveryStore) and store.name == "file"
    long_key = "v1/mdc/" + "m" * 300
    await store.put("v1/mdc/a", b"card")
    await store.put(long_key, b"long")
    await store.put("v1/other/b", b"\x00\nbinary")
    assert await store.get("v1/mdc/a") == b"card"
    assert await store.get("v1/other/b") == b"\x00\nbinary"
    assert await store.get("v1/none") is None
    assert await store.get_prefix("v1/mdc/") == {"v1/mdc/a": b"card", long_key: b"long"}
    await store.delete("v1/mdc/a")
    assert await store.get_prefix("v1/mdc/") == {long_key: b"long"}
    # Unleased keys persist: another store on the same directory sees them after this one closed.
    await store.close()
    again = FileStore(root)
    await again.start()
    assert await again.get_prefix("v1/") == {long_key: b"long", "v1/other/b": b"\x00\nbinary"}
    await again.close()


async def test_watch_snapshot_then_changes_and_revoke(store: FileStore) -> None:
    await store.put("p/a", b"1")
    watch = store.watch_prefix("p/")
    ev = await asyncio.wait_for(watch.__anext__(), 2)
    assert (ev.kind, ev.key, ev.value) == (WatchEventKind.PUT, "p/a", b"1")
    lease = await store.create_lease(TTL)
    await store.put("p/b", b"2", lease)
    await store.put("q/ignored", b"x")
    ev = await asyncio.wait_for(watch.__anext__(), 2)
    assert (ev.kind, ev.key, ev.value) == (WatchEventKind.PUT, "p/b", b"2")
    await store.put("p/a", b"1b")
    ev = await asyncio.wait_for(watch.__anext__(), 2)
    assert (ev.kind, ev.key, ev.value) == (WatchEventKind.PUT, "p/a", b"1b")
    await lease.revoke()
    ev = await asyncio.wait_for(watch.__anext__(), 2)
    assert (ev.kind, ev.key) == (WatchEventKind.DELETE, "p/b")
    with pytest.raises(DiscoveryError):
        await store.put("p/c", b"3", lease)
    await watch.aclose()


async def test_close_ends_watches(store: FileStore) -> None:
    watch = WatchRecorder(store, "p/").start()
    await store.put("p/a", b"1")
    await watch.wait_for(lambda v: "p/a" in v, 2, "put")
    await store.close()
    await watch.wait_ended(2)


async def test_unusable_directory_gives_actionable_error(tmp_path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    s = FileStore(str(not_a_dir / "kv"))
    with pytest.raises(DiscoveryError) as info:
        await s.start()
    assert "DYN_FILE_KV" in str(info.value) and str(not_a_dir) in str(info.value)


# -- several processes ------------------------------------------------------------------------


async def test_child_registration_is_discovered_within_a_second_and_gone_within_ttl_after_kill9(
    store: FileStore, children
) -> None:
    watch = WatchRecorder(store, PREFIX).start()
    started = time.monotonic()
    child = await children(TTL, {KEY: "worker-1", "+" + PREFIX + "unleased": "stays"})
    seen_at = await watch.wait_for(lambda v: v.get(KEY) == b"worker-1", 5, "registration")
    assert seen_at - started < 5  # includes the child's interpreter start-up
    assert await store.get_prefix(PREFIX) == {KEY: b"worker-1", PREFIX + "unleased": b"stays"}

    killed_at = time.monotonic()
    child.kill9()
    gone_at = await watch.wait_for(lambda v: KEY not in v, TTL + 2.0, "key removed after kill -9")
    assert gone_at - killed_at <= TTL + 0.5  # one TTL plus a poll interval or two
    # The dead entry was garbage-collected; the unleased key persists.
    assert await store.get(KEY) is None
    assert os.listdir(os.path.join(store.root, "keys")) == [encode_key(PREFIX + "unleased")]
    assert watch.view == {PREFIX + "unleased": b"stays"}
    await watch.stop()


async def test_child_registration_seen_by_new_instance_within_one_second(store: FileStore, children) -> None:
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: True, 1, "watch start")
    child = await children(10.0, {KEY: "worker-1"})
    ready_at = time.monotonic()  # the child printed READY after its put
    seen_at = await watch.wait_for(lambda v: KEY in v, 2, "new instance")
    assert seen_at - ready_at < 1.0
    await child.close()


async def test_clean_close_removes_keys_at_once(store: FileStore, children) -> None:
    child = await children(30.0, {KEY: "w", KEY + "/lora": "l"})
    await check_close_removes_keys(store, PREFIX, child, 2.0)
    assert os.listdir(os.path.join(store.root, "leases")) == []


async def test_stopped_process_disappears_then_comes_back_by_itself(store: FileStore, children) -> None:
    child = await children(TTL, {KEY: "worker-1"})
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: KEY in v, 2, "snapshot")
    child.pause()  # SIGSTOP: no heartbeats, like a process stuck longer than its TTL
    await watch.wait_for(lambda v: KEY not in v, TTL + 2.0, "stopped process removed")
    child.resume()
    await watch.wait_for(lambda v: v.get(KEY) == b"worker-1", TTL + 2.0, "process back after SIGCONT")
    assert child.lease_id == int(next(iter(os.listdir(os.path.join(store.root, "leases")))).split(".")[0], 16)
    await child.close()
    await watch.wait_for(lambda v: not v, 2, "keys removed by close()")
    await watch.stop()


# -- factory ----------------------------------------------------------------------------------


def test_default_file_kv_dir(monkeypatch) -> None:
    monkeypatch.setenv("DYN_FILE_KV", "/somewhere/kv")
    assert default_file_kv_dir() == "/somewhere/kv"
    monkeypatch.delenv("DYN_FILE_KV")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_file_kv_dir() == f"/run/user/1000/dynamod-{os.getuid()}/discovery"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_file_kv_dir() == f"/tmp/dynamod-{os.getuid()}/discovery"


def test_make_store_by_name(root: str) -> None:
    file_store = make_store("file", file_root=root)
    assert isinstance(file_store, FileStore) and file_store.root == root
    default_store = make_store("file")
    assert isinstance(default_store, FileStore) and default_store.root == os.path.abspath(
        default_file_kv_dir()
    )
    assert isinstance(make_store("mem"), MemStore)
    assert BACKENDS == ("etcd", "file", "mem")
    with pytest.raises(ConfigError) as info:
        make_store("zookeeper")
    assert all(name in str(info.value) for name in BACKENDS)
