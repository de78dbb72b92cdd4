"""File discovery on a full disk: a write fails with a ``DiscoveryError`` that says the disk is full
and names the directory; the heartbeat keeps trying, logs the episode once (not every beat), and
logs its end; the lease beats again once space is back.

The failure is injected where the store meets the OS (``os.replace`` of the atomic write, as a
full file system fails the write or the rename of the temp file), and, when this runs as root, on
a real 64 KiB tmpfs filled to the brim."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from dynamod.shared.discovery import file as file_mod
from dynamod.shared.discovery.file import DiscoveryDiskFullError, FileStore
from dynamod.shared.errors import DiscoveryError
from tests.fixtures.disk import tiny_tmpfs

pytestmark = pytest.mark.timeout(60)

LOGGER = "dynamod.shared.discovery.file"


class DiskFull:
    """``os.replace`` and ``os.link`` fail with ``errno_`` while ``on`` (only in ``root``, so other
    users of ``os`` in the test process are untouched); ``calls`` counts the failed attempts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, errno_: int = errno.ENOSPC) -> None:
        self.on = False
        self.calls = 0
        real_replace, real_link = os.replace, os.link
        root_s = str(root)

        def wrap(real: Callable[..., None]) -> Callable[..., None]:
            def call(src: str, dst: str, *a: object, **kw: object) -> None:
                if self.on and str(dst).startswith(root_s):
                    self.calls += 1
                    raise OSError(errno_, os.strerror(errno_), str(dst))
                real(src, dst, *a, **kw)

            return call

        monkeypatch.setattr(file_mod.os, "replace", wrap(real_replace))
        monkeypatch.setattr(file_mod.os, "link", wrap(real_link))


async def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")]


def lease_beat(root: Path) -> int:
    (path,) = list((root / "leases").glob("*.lease"))
    return int(json.loads(path.read_bytes())["beat"])


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileStore]:
    s = FileStore(str(tmp_path / "kv"), poll_interval_s=0.05)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def test_a_put_on_a_full_disk_says_so_and_names_the_directory(
    store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.put("v1/a", b"old")
    full = DiskFull(monkeypatch, tmp_path)
    full.on = True
    with pytest.raises(DiscoveryError) as info:
        await store.put("v1/a", b"new")
    assert isinstance(info.value, DiscoveryDiskFullError)
    message = str(info.value)
    assert "disk is full" in message and "ENOSPC" in message
    assert os.path.join(store.root, "keys") in message
    assert temp_files(tmp_path) == []  # the half-written temp file is gone
    full.on = False
    assert await store.get("v1/a") == b"old"  # the old entry is intact


async def test_a_lease_on_a_full_disk_says_so(store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    DiskFull(monkeypatch, tmp_path).on = True
    with pytest.raises(DiscoveryDiskFullError, match="disk is full") as info:
        await store.create_lease(ttl=3.0)
    assert os.path.join(store.root, "leases") in str(info.value)


async def test_a_quota_exceeded_is_named_as_such(store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    DiskFull(monkeypatch, tmp_path, errno.EDQUOT).on = True
    with pytest.raises(DiscoveryDiskFullError, match=r"disk quota is exceeded \(EDQUOT\)"):
        await store.put("v1/a", b"x")


async def test_other_write_errors_are_not_called_a_full_disk(
    store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    DiskFull(monkeypatch, tmp_path, errno.EIO).on = True
    with pytest.raises(DiscoveryError) as info:
        await store.put("v1/a", b"x")
    assert not isinstance(info.value, DiscoveryDiskFullError)
    assert "full" not in str(info.value)


async def test_the_heartbeat_logs_a_full_disk_once_per_episode_and_keeps_trying(
    store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    lease = await store.create_lease(ttl=0.3)  # a beat every 0.1 s
    await store.put("v1/mine", b"x", lease=lease)
    root = Path(store.root)
    full = DiskFull(monkeypatch, tmp_path)

    def failing_logs() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "heartbeat failing" in r.getMessage()]

    for episode in (1, 2):
        full.on = True
        start = full.calls
        await wait_for(lambda start=start: full.calls - start >= 5, 10, "five failed beats")
        assert lease.task is not None and not lease.task.done(), "the heartbeat loop must survive a full disk"
        logs = failing_logs()
        assert len(logs) == episode, [r.getMessage() for r in logs]  # once per episode, not per beat
        assert logs[-1].levelno == logging.ERROR
        assert "disk is full" in logs[-1].getMessage() and str(root / "leases") in logs[-1].getMessage()
        before = lease_beat(root)
        full.on = False
        await wait_for(lambda before=before: lease_beat(root) > before, 10, "a beat after space came back")
        await wait_for(
            lambda n=episode: sum("heartbeat recovered" in r.getMessage() for r in caplog.records) == n, 10, "recovery"
        )
    assert temp_files(tmp_path) == []
    assert await store.get("v1/mine") == b"x"


# -- a real full file system ------------------------------------------------------------------


def fill(path: Path) -> None:
    """Writes ``path`` until the file system has no block left."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_a_real_full_tmpfs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    mount = tmp_path / "small"
    with tiny_tmpfs(mount):
        store = FileStore(str(mount / "kv"), poll_interval_s=0.05)
        await store.start()
        try:
            lease = await store.create_lease(ttl=0.3)
            await store.put("v1/mine", b"x", lease=lease)
            ballast = mount / "ballast"
            await asyncio.to_thread(fill, ballast)
            with pytest.raises(DiscoveryDiskFullError, match="disk is full") as info:
                await store.put("v1/big", b"y" * 16384)
            assert str(mount / "kv" / "keys") in str(info.value)
            await wait_for(lambda: any("heartbeat failing" in r.getMessage() for r in caplog.records), 10, "log")
            await asyncio.sleep(0.5)  # several more beats fail meanwhile
            assert sum("heartbeat failing" in r.getMessage() for r in caplog.records) == 1
            before = lease_beat(mount / "kv")
            ballast.unlink()
            await wait_for(lambda: lease_beat(mount / "kv") > before, 10, "a beat after space came back")
            await store.put("v1/big", b"y" * 16384)
            assert await store.get("v1/big") == b"y" * 16384
        finally:
            await store.close()
