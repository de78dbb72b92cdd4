"""File discovery (``file``): several processes on ONE host share a directory, no server needed.

Layout under ``root`` (``dynamod up``, dynamoctl and the console share the default root, see
``factory.default_file_kv_dir``)::

    keys/<encoded key>               header line (JSON: key, lease id) + "\\n" + the value bytes
    leases/<id:016x>.<ttl_ms>.lease  JSON (id, ttl, pid, host) for humans; its *mtime* is the heartbeat

Why it is built this way:

* Every write is ``temp file + os.replace``, so a reader never sees half an entry.
* An entry is alive if it has no lease, or if its lease file exists and was touched within the
  lease TTL (the TTL is in the lease file's name, so liveness needs no file reads). The owner
  touches it every ``ttl/3``; a process killed with ``-9`` stops touching, and its entries count as
  gone one TTL later. Whoever notices a dead entry deletes it (garbage collection by readers).
* An owner that was paused past its TTL (its entries may have been collected) notices on its next
  heartbeat, re-creates the lease file under the same id and puts its keys again, like a lease
  re-granted after an etcd outage.
* Key file names keep ``[A-Za-z0-9_-]`` and percent-encode every other byte, so a key prefix is a
  file-name prefix and scans only read matching files; names too long for the file system become
  ``~<sha256>`` (the real key is in the header).
* Scans run in a worker thread (``asyncio.to_thread``) and re-read only entries whose
  (inode, mtime, size) changed, so polling every 0.2 s stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dynamod.shared.discovery.store import DEFAULT_LEASE_TTL_S, WatchEvent, WatchEventKind
from dynamod.shared.errors import DiscoveryError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_NAME = 200  # below NAME_MAX (255) with room for the temp-file suffix
_HASHED = "~"
_TMP = ".tmp-"
_TMP_MAX_AGE_S = 60.0
_LEASE_SUFFIX = ".lease"
# A lease file this much older than its TTL is removed (its entries went first, at one TTL).
_LEASE_FILE_GRACE_FACTOR = 2.0
# The owner re-puts its keys if its own lease file got this close to looking dead.
_OWNER_STALE_FACTOR = 0.9


def encode_key(key: str) -> str:
    """A file name for ``key``; prefix-preserving except for hashed (over-long) names."""
    raw = key.encode()
    name = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(name) > _MAX_NAME:
        return _HASHED + hashlib.sha256(raw).hexdigest()
    return name


def decode_key(name: str) -> str | None:
    """The key of a plain (not hashed) file name; None for names this store did not write."""
    if not name or name.startswith((_HASHED, ".")):
        return None
    out = bytearray()
    i = 0
    try:
        while i < len(name):
            if name[i] == "%":
                out.append(int(name[i + 1 : i + 3], 16))
                i += 3
            else:
                out.append(ord(name[i]))
                i += 1
        return out.decode()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


@dataclass(frozen=True, slots=True)
class _Entry:
    key: str
    lease_id: int
    value: bytes
    version: tuple[int, int, int]  # (inode, mtime_ns, size): changes on every write


@dataclass(frozen=True, slots=True)
class _LeaseFile:
    name: str
    ttl_s: float
    mtime: float


class _Layout:
    """The on-disk format and every blocking file operation. Call only from a worker thread."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.keys_dir = os.path.join(root, "keys")
        self.leases_dir = os.path.join(root, "leases")

    def make_dirs(self) -> None:
        for path in (self.keys_dir, self.leases_dir):
            os.makedirs(path, mode=0o700, exist_ok=True)

    def ensure(self) -> None:
        self.make_dirs()
        probe = os.path.join(self.keys_dir, f"{_TMP}probe-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)

    # -- atomic writes -----------------------------------------------------------------------

    def _write_atomic(self, directory: str, name: str, data: bytes, *, exclusive: bool = False) -> None:
        tmp = os.path.join(directory, f"{_TMP}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            if exclusive:  # link fails if the name exists: atomic create-if-absent
                os.link(tmp, os.path.join(directory, name))
            else:
                os.replace(tmp, os.path.join(directory, name))
                tmp = ""
        finally:
            if tmp:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def write_entry(self, key: str, value: bytes, lease_id: int) -> None:
        header = json.dumps({"key": key, "lease": lease_id}, separators=(",", ":")).encode()
        self._write_atomic(self.keys_dir, encode_key(key), header + b"\n" + value)

    def delete_entry(self, key: str, *, only_lease: int | None = None) -> bool:
        """Deletes ``key``; with ``only_lease``, only if the entry still belongs to that lease."""
        path = os.path.join(self.keys_dir, encode_key(key))
        if only_lease is not None:
            entry = self.read_entry_path(path)
            if entry is None or entry.lease_id != only_lease:
                return False
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def read_entry_path(self, path: str) -> _Entry | None:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None
        header, sep, value = data.partition(b"\n")
        try:
            meta = json.loads(header)
            return _Entry(
                str(meta["key"]), int(meta.get("lease") or 0), value, (st.st_ino, st.st_mtime_ns, st.st_size)
            )
        except (ValueError, KeyError, TypeError):
            if sep:  # a complete but foreign/corrupt file: ignore it, never crash a reader
                logger.warning("file discovery ignoring unreadable entry path=%s", path)
            return None

    # -- leases ------------------------------------------------------------------------------

    @staticmethod
    def lease_name(lease_id: int, ttl_s: float) -> str:
        return f"{lease_id:016x}.{max(1, round(ttl_s * 1000))}{_LEASE_SUFFIX}"

    def lease_path(self, lease_id: int, ttl_s: float) -> str:
        return os.path.join(self.leases_dir, self.lease_name(lease_id, ttl_s))

    def _lease_body(self, lease_id: int, ttl_s: float) -> bytes:
        body = {"id": f"{lease_id:x}", "ttl": ttl_s, "pid": os.getpid(), "host": socket.gethostname()}
        return json.dumps(body).encode()

    def create_lease(self, ttl_s: float) -> int:
        while True:
            lease_id = secrets.randbits(62) + 1
            try:
                self._write_atomic(
                    self.leases_dir,
                    self.lease_name(lease_id, ttl_s),
                    self._lease_body(lease_id, ttl_s),
                    exclusive=True,
                )
                return lease_id
            except FileExistsError:
                continue

    def restore_lease(self, lease_id: int, ttl_s: float) -> None:
        self._write_atomic(
            self.leases_dir, self.lease_name(lease_id, ttl_s), self._lease_body(lease_id, ttl_s)
        )

    def touch_lease(self, lease_id: int, ttl_s: float) -> bool:
        """The owner's heartbeat. False if the lease file is gone or nearly counted dead, so the
        owner must restore it and put its keys again."""
        path = self.lease_path(lease_id, ttl_s)
        try:
            age = time.time() - os.stat(path).st_mtime
            os.utime(path)
        except FileNotFoundError:
            return False
        return age <= ttl_s * _OWNER_STALE_FACTOR

    def remove_lease(self, lease_id: int, ttl_s: float) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lease_path(lease_id, ttl_s))

    def live_leases(self, now: float, *, gc: bool) -> dict[int, _LeaseFile]:
        live: dict[int, _LeaseFile] = {}
        with os.scandir(self.leases_dir) as it:
            for de in it:
                if de.name.startswith(_TMP):
                    if gc:
                        self._gc_tmp(de, now)
                    continue
                parsed = _parse_lease_name(de.name)
                if parsed is None:
                    continue
                lease_id, ttl_s = parsed
                try:
                    mtime = de.stat().st_mtime
                except FileNotFoundError:
                    continue
                age = now - mtime
                if age <= ttl_s:
                    live[lease_id] = _LeaseFile(de.name, ttl_s, mtime)
                elif gc and age > ttl_s * _LEASE_FILE_GRACE_FACTOR:
                    self._gc_lease_file(de.path, ttl_s)
        return live

    def _gc_lease_file(self, path: str, ttl_s: float) -> None:
        try:  # re-check right before unlinking: the owner may have just touched it
            if time.time() - os.stat(path).st_mtime > ttl_s * _LEASE_FILE_GRACE_FACTOR:
                os.unlink(path)
                logger.info("file discovery removed dead lease path=%s", path)
        except FileNotFoundError:
            pass

    def _gc_tmp(self, de: os.DirEntry[str], now: float) -> None:
        with contextlib.suppress(FileNotFoundError):
            if now - de.stat().st_mtime > _TMP_MAX_AGE_S:
                os.unlink(de.path)

    def _lease_alive_now(self, lease_id: int) -> bool:
        """Fresh look at one lease (by id, any TTL) just before collecting its entries."""
        prefix = f"{lease_id:016x}."
        now = time.time()
        with os.scandir(self.leases_dir) as it:
            for de in it:
                if de.name.startswith(prefix):
                    parsed = _parse_lease_name(de.name)
                    with contextlib.suppress(FileNotFoundError):
                        if parsed and now - de.stat().st_mtime <= parsed[1]:
                            return True
        return False


class _Scanner:
    """Lists live entries under a prefix, re-reading only files that changed since its last scan.
    One per watcher (or per call), so no cache is shared between threads."""

    def __init__(self, layout: _Layout) -> None:
        self._layout = layout
        self._cache: dict[str, _Entry] = {}

    def scan(self, prefix: str, *, gc: bool = True) -> dict[str, _Entry]:
        layout = self._layout
        now = time.time()
        leases = layout.live_leases(now, gc=gc)
        name_prefix = encode_key(prefix) if prefix else ""
        if name_prefix.startswith(_HASHED):  # an over-long prefix: only hashed names can match
            name_prefix = _HASHED
        seen: dict[str, _Entry] = {}
        fresh_cache: dict[str, _Entry] = {}
        dead: list[tuple[str, _Entry]] = []
        with os.scandir(layout.keys_dir) as it:
            for de in it:
                name = de.name
                if name.startswith(_TMP):
                    if gc:
                        layout._gc_tmp(de, now)
                    continue
                if not (name.startswith(name_prefix) or name.startswith(_HASHED)):
                    continue
                try:
                    st = de.stat()
                except FileNotFoundError:
                    continue
                version = (st.st_ino, st.st_mtime_ns, st.st_size)
                entry = self._cache.get(name)
                if entry is None or entry.version != version:
                    entry = layout.read_entry_path(de.path)
                    if entry is None:
                        continue
                fresh_cache[name] = entry
                if not entry.key.startswith(prefix):
                    continue
                if entry.lease_id and entry.lease_id not in leases:
                    dead.append((de.path, entry))
                    continue
                seen[entry.key] = entry
        self._cache = fresh_cache
        if gc:
            for path, entry in dead:
                self._collect(path, entry)
        return seen

    def _collect(self, path: str, entry: _Entry) -> None:
        """Deletes an entry whose lease is dead, unless the lease came back or the entry was
        rewritten since we looked (the owner restoring it)."""
        layout = self._layout
        if layout._lease_alive_now(entry.lease_id):
            return
        try:
            st = os.stat(path)
            if (st.st_ino, st.st_mtime_ns, st.st_size) == entry.version:
                os.unlink(path)
                logger.info("file discovery collected expired key=%s lease=%x", entry.key, entry.lease_id)
        except FileNotFoundError:
            pass


def _parse_lease_name(name: str) -> tuple[int, float] | None:
    if not name.endswith(_LEASE_SUFFIX):
        return None
    parts = name[: -len(_LEASE_SUFFIX)].split(".")
    if len(parts) != 2:
        return None
    try:
        return int(parts[0], 16), int(parts[1]) / 1000.0
    except ValueError:
        return None


class FileLease:
    """A lease of this process, backed by a lease file it touches every ttl/3. The id never
    changes: a lost lease file is re-created under the same id."""

    def __init__(self, store: FileStore, lease_id: int, ttl: float) -> None:
        self._store = store
        self._id = lease_id
        self._ttl = ttl
        self.keys: dict[str, bytes] = {}
        self.revoked = False
        self.lock = asyncio.Lock()  # a put never races a restore of the lease file
        self.task: asyncio.Task[None] | None = None

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> float:
        return self._ttl

    async def revoke(self) -> None:
        await self._store._revoke(self)


class FileStore:
    """Discovery in a shared directory on one host."""

    name = "file"

    def __init__(self, root: str, *, poll_interval_s: float = 0.2) -> None:
        if not root:
            raise DiscoveryError("file discovery needs a directory; set DYN_FILE_KV")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.poll_interval_s = poll_interval_s
        self._layout = _Layout(self.root)
        self._leases: list[FileLease] = []
        self._started = False
        self._closed = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        try:
            await asyncio.to_thread(self._layout.ensure)
        except OSError as exc:
            raise DiscoveryError(
                f"file discovery cannot use {self.root} ({exc.strerror or exc}); "
                "set DYN_FILE_KV to a writable directory shared by the processes of this host"
            ) from exc
        self._started = True
        logger.info("file discovery opened root=%s", self.root)

    async def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        await asyncio.gather(*(self._revoke(lease) for lease in list(self._leases)), return_exceptions=True)
        logger.info("file discovery closed root=%s", self.root)

    # -- leases ------------------------------------------------------------------------------

    async def create_lease(self, ttl: float = DEFAULT_LEASE_TTL_S) -> FileLease:
        self._check_open()
        if ttl <= 0:
            raise DiscoveryError(f"lease ttl must be positive, got {ttl}")
        lease_id = await self._io("create lease", self._layout.create_lease, ttl)
        lease = FileLease(self, lease_id, ttl)
        lease.task = asyncio.create_task(self._heartbeat_loop(lease), name=f"file-lease-{lease_id:x}")
        self._leases.append(lease)
        return lease

    async def _heartbeat_loop(self, lease: FileLease) -> None:
        failing = False
        while not lease.revoked:
            await asyncio.sleep(lease.ttl / 3)
            try:
                async with lease.lock:
                    if lease.revoked:
                        return
                    ok = await asyncio.to_thread(self._layout.touch_lease, lease.id, lease.ttl)
                    if not ok:
                        await asyncio.to_thread(self._restore_sync, lease.id, lease.ttl, dict(lease.keys))
                        logger.warning(
                            "file discovery lease restored lease=%x keys_reput=%d reason=lease_file_missing_or_stale",
                            lease.id,
                            len(lease.keys),
                        )
            except OSError as exc:
                if not failing:
                    logger.warning("file discovery heartbeat failing lease=%x error=%s", lease.id, exc)
                failing = True
                continue
            if failing:
                logger.info("file discovery heartbeat recovered lease=%x", lease.id)
                failing = False

    def _put_leased_sync(self, lease: FileLease, key: str, value: bytes) -> None:
        # A put must not land under a lease file that others already count as dead.
        if not self._layout.touch_lease(lease.id, lease.ttl):
            self._restore_sync(lease.id, lease.ttl, dict(lease.keys))
            logger.warning(
                "file discovery lease restored lease=%x keys_reput=%d reason=put_on_stale_lease",
                lease.id,
                len(lease.keys),
            )
        self._layout.write_entry(key, value, lease.id)

    def _restore_sync(self, lease_id: int, ttl: float, keys: dict[str, bytes]) -> None:
        self._layout.make_dirs()  # the directory itself may have been wiped (tmp cleaners)
        self._layout.restore_lease(lease_id, ttl)
        for key, value in keys.items():
            self._layout.write_entry(key, value, lease_id)

    async def _revoke(self, lease: FileLease) -> None:
        if lease.revoked:
            return
        lease.revoked = True
        if lease in self._leases:
            self._leases.remove(lease)
        if lease.task is not None and lease.task is not asyncio.current_task():
            lease.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lease.task
        keys = list(lease.keys)
        lease.keys.clear()

        def revoke_sync() -> None:
            for key in keys:
                self._layout.delete_entry(key, only_lease=lease.id)
            self._layout.remove_lease(lease.id, lease.ttl)

        try:
            await asyncio.to_thread(revoke_sync)
        except OSError as exc:
            logger.warning(
                "file discovery revoke failed lease=%x error=%s keys_expire_within_s=%g",
                lease.id,
                exc,
                lease.ttl,
            )

    # -- key/value ---------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: FileLease | None = None) -> None:  # type: ignore[override]
        self._check_open()
        if not key:
            raise DiscoveryError("discovery keys must be non-empty")
        if lease is None:
            await self._io(f"put {key}", self._layout.write_entry, key, value, 0)
        else:
            if lease.revoked or lease._store is not self:
                raise DiscoveryError(
                    f"lease {lease.id:x} was revoked or belongs to another store; cannot put {key}"
                )
            async with lease.lock:
                await self._io(f"put {key}", self._put_leased_sync, lease, key, value)
                lease.keys[key] = value
        for other in self._leases:
            if other is not lease:
                other.keys.pop(key, None)

    async def delete(self, key: str) -> None:
        self._check_open()
        await self._io(f"delete {key}", self._layout.delete_entry, key)
        for lease in self._leases:
            lease.keys.pop(key, None)

    async def get(self, key: str) -> bytes | None:
        self._check_open()
        if not key:
            return None
        return await self._io(f"get {key}", self._get_sync, key)

    def _get_sync(self, key: str) -> bytes | None:
        path = os.path.join(self._layout.keys_dir, encode_key(key))
        entry = self._layout.read_entry_path(path)
        if entry is None or entry.key != key:
            return None
        if entry.lease_id and not self._layout._lease_alive_now(entry.lease_id):
            _Scanner(self._layout)._collect(path, entry)
            return None
        return entry.value

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        self._check_open()
        entries = await self._io(f"get_prefix {prefix}", _Scanner(self._layout).scan, prefix)
        return {k: e.value for k, e in entries.items()}

    async def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:  # type: ignore[override]
        self._check_open()
        scanner = _Scanner(self._layout)
        view = await self._io(f"watch {prefix}", scanner.scan, prefix)
        for key in sorted(view):
            yield WatchEvent(WatchEventKind.PUT, key, view[key].value)
        failing = False
        while not self._closed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.poll_interval_s)
                return
            try:
                now = await asyncio.to_thread(scanner.scan, prefix)
            except OSError as exc:  # a transient file-system error must not end the watch
                if not failing:
                    logger.warning("file discovery watch scan failing prefix=%s error=%s", prefix, exc)
                failing = True
                continue
            if failing:
                logger.info("file discovery watch scan recovered prefix=%s", prefix)
                failing = False
            for key in sorted(view.keys() - now.keys()):
                yield WatchEvent(WatchEventKind.DELETE, key)
            for key in sorted(now):
                old = view.get(key)
                if old is None or old.version != now[key].version:
                    yield WatchEvent(WatchEventKind.PUT, key, now[key].value)
            view = now

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise DiscoveryError("file discovery store is closed")
        if not self._started:
            raise DiscoveryError("file discovery store is not started; call start() first")

    async def _io(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            raise DiscoveryError(f"file discovery {what} failed in {self.root}: {exc}") from exc
