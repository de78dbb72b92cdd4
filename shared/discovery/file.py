"""File discovery (``file``): several processes on ONE host share a directory, no server needed.

Layout under ``root`` (``dynamod up``, dynamoctl and the console share the default root, see
``factory.default_file_kv_dir``)::

    keys/<encoded key>               header line (JSON: key, lease id) + "\\n" + the value bytes
    leases/<id:016x>.<ttl_ms>.lease  JSON: id, ttl, beat (the heartbeat counter), and the owner
                                     (pid, host, boot id, pid namespace, process start time)

Why it is built this way:

* Every write is ``temp file + os.replace``, so a reader never sees half an entry or lease.
* Liveness is judged by each reader on its own monotonic clock, from a heartbeat counter the owner
  increments every ``ttl/3`` (``file_liveness`` has the rules): an entry is visible if it has no
  lease, or its lease's counter moved within the TTL as this reader saw it. Nothing compares a file
  mtime with the wall clock, so a wall-clock step deletes and hides nobody, and a reader that first
  sees a lease gives it a full TTL.
* A late owner's entries are hidden, not deleted: readers delete (garbage-collect) entries only
  when the owner process is provably gone (``/proc``: a kill -9 shows at the next scan), or,
  without such evidence, after twice the TTL without a beat; and only after re-checking that the
  lease file did not change meanwhile. Entries of an owner that still exists (stopped, hung,
  starved) are never deleted by a reader; they reappear on its next beat.
* The owner checks its keys on every beat and puts back any that are missing, and re-creates a
  missing lease file under the same id (logged as "lease restored"): for real losses (a directory
  wiped by a tmp cleaner, an older dynamod's reader that still collects by mtime), like a lease
  re-granted after an etcd outage.
* Key file names keep ``[A-Za-z0-9_-]`` and percent-encode every other byte, so a key prefix is a
  file-name prefix and scans only read matching files; names too long for the file system become
  ``~<sha256>`` (the real key is in the header).
* Scans run in a worker thread (``asyncio.to_thread``) and re-read only entries and lease files
  whose (inode, mtime, size) changed, so polling every 0.2 s stays cheap.

Compatibility: the names are unchanged. An older dynamod's owner (no counter, it only touches the
file) is judged by its file's mtime *changing*, not by its age; an older reader judges our lease
files by mtime age, which our rewrite every beat keeps fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dynamod.shared.discovery.file_liveness import (
    LeaseJudge,
    Marker,
    OwnerIdentity,
    Signature,
    Verdict,
    this_process,
)
from dynamod.shared.discovery.file_poll import SharedPoll
from dynamod.shared.discovery.store import (
    DEFAULT_LEASE_TTL_S,
    KeptAliveLease,
    PrefixListing,
    WatchEvent,
    WatchEventKind,
    diff_events,
)
from dynamod.shared.errors import DiscoveryError
from dynamod.shared.security.private_dir import ensure_private_dir, private_root_for

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_NAME = 200  # below NAME_MAX (255) with room for the temp-file suffix
_HASHED = "~"
_TMP = ".tmp-"
_TMP_MAX_AGE_S = 60.0  # a temp file a reader has seen this long was left by a crashed writer
_LEASE_SUFFIX = ".lease"
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiscoveryDiskFullError(DiscoveryError):
    """A discovery write failed because the file system (or the user's quota) is full: said so
    plainly, with the directory, instead of a bare ``OSError`` deep in a heartbeat."""

    code = "discovery_disk_full"

    @classmethod
    def for_write(cls, directory: str, exc: OSError) -> DiscoveryDiskFullError:
        what = "the disk quota is exceeded" if exc.errno == errno.EDQUOT else "the disk is full"
        name = errno.errorcode.get(exc.errno or 0, "?")
        return cls(
            f"file discovery cannot write to {directory}: {what} ({name}); free space on that file "
            "system (or set DYN_FILE_KV to a directory on another one). Leases and entries are not "
            "renewed until then, so readers stop seeing this process's instances"
        )


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


class _Layout:
    """The on-disk format and every blocking file operation. Call only from a worker thread."""

    def __init__(self, root: str, judge: LeaseJudge) -> None:
        self.root = root
        self.keys_dir = os.path.join(root, "keys")
        self.leases_dir = os.path.join(root, "leases")
        self.judge = judge

    def make_dirs(self) -> None:
        for path in (self.keys_dir, self.leases_dir):
            os.makedirs(path, mode=0o700, exist_ok=True)

    def ensure(self) -> None:
        # Records here say where prompts go: the directory must be this user's alone (private_dir).
        ensure_private_dir(self.root, what="file discovery", owned_from=private_root_for(self.root))
        self.make_dirs()
        # Unique per call: two stores of one process starting at once must not share the probe.
        probe = os.path.join(self.keys_dir, f"{_TMP}probe-{os.getpid()}-{secrets.token_hex(6)}")
        with open(probe, "wb"):
            pass
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)

    # -- atomic writes -----------------------------------------------------------------------

    def _write_atomic(self, directory: str, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Writes ``name`` whole or not at all; ``DiscoveryDiskFullError`` when the file system is
        full (the temp file is removed, the old entry stays as it was)."""
        tmp = os.path.join(directory, f"{_TMP}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            if exclusive:  # link fails if the name exists: atomic create-if-absent
                os.link(tmp, os.path.join(directory, name))
            else:
                os.replace(tmp, os.path.join(directory, name))
                tmp = ""
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise DiscoveryDiskFullError.for_write(directory, exc) from exc
            raise
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

    # -- leases: the owner's side ------------------------------------------------------------

    @staticmethod
    def lease_name(lease_id: int, ttl_s: float) -> str:
        return f"{lease_id:016x}.{max(1, round(ttl_s * 1000))}{_LEASE_SUFFIX}"

    def lease_path(self, lease_id: int, ttl_s: float) -> str:
        return os.path.join(self.leases_dir, self.lease_name(lease_id, ttl_s))

    @staticmethod
    def _lease_body(lease_id: int, ttl_s: float, beat: int) -> bytes:
        body = {"id": f"{lease_id:x}", "ttl": ttl_s, "beat": beat, **this_process().to_json()}
        return json.dumps(body).encode()

    def create_lease(self, ttl_s: float) -> int:
        while True:
            lease_id = secrets.randbits(62) + 1
            try:
                self._write_atomic(
                    self.leases_dir,
                    self.lease_name(lease_id, ttl_s),
                    self._lease_body(lease_id, ttl_s, 0),
                    exclusive=True,
                )
                return lease_id
            except FileExistsError:
                continue

    def lease_exists(self, lease_id: int, ttl_s: float) -> bool:
        return os.path.exists(self.lease_path(lease_id, ttl_s))

    def beat(
        self, lease_id: int, ttl_s: float, beat: int, keys: dict[str, bytes]
    ) -> tuple[bool, list[str], list[str]]:
        """The owner's heartbeat: rewrites the lease file with counter ``beat``, then checks its keys.

        Returns (lease file was missing, keys put back because they were missing, keys now held by
        another lease: no longer ours)."""
        name = self.lease_name(lease_id, ttl_s)
        missing = not os.path.exists(os.path.join(self.leases_dir, name))
        body = self._lease_body(lease_id, ttl_s, beat)
        try:
            self._write_atomic(self.leases_dir, name, body)
        except FileNotFoundError:  # the directory itself was wiped (tmp cleaners)
            self.make_dirs()
            self._write_atomic(self.leases_dir, name, body)
        reput: list[str] = []
        foreign: list[str] = []
        for key, value in keys.items():
            entry = self.read_entry_path(os.path.join(self.keys_dir, encode_key(key)))
            if entry is None or entry.key != key:
                self.write_entry(key, value, lease_id)
                reput.append(key)
            elif entry.lease_id != lease_id:
                foreign.append(key)
        return missing, reput, foreign

    def remove_lease(self, lease_id: int, ttl_s: float) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lease_path(lease_id, ttl_s))

    # -- leases: the readers' side -----------------------------------------------------------

    def _read_lease(self, path: str) -> tuple[Marker, OwnerIdentity | None] | None:
        try:
            with open(path, "rb") as f:
                mtime_ns = os.fstat(f.fileno()).st_mtime_ns
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            body = json.loads(data)
            beat = body.get("beat") if isinstance(body, dict) else None
        except ValueError:
            body, beat = None, None
        if not isinstance(beat, int):  # an older owner: it only touches the file
            return mtime_ns, None
        return beat, OwnerIdentity.from_json(body)

    def judge_leases(self, own: frozenset[int], *, gc: bool) -> dict[int, tuple[Verdict, float]]:
        """lease id -> (verdict, ttl) for every lease file; with ``gc``, collects the dead ones."""
        judge = self.judge
        verdicts: dict[int, tuple[Verdict, float]] = {}
        to_reap: list[tuple[int, float, Signature]] = []
        with judge.lock:
            now = judge.clock()
            present: set[int] = set()
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
                    if lease_id in own:
                        verdicts[lease_id] = (Verdict.ALIVE, ttl_s)
                        continue
                    try:
                        st = de.stat()
                    except FileNotFoundError:
                        continue
                    sig = (st.st_ino, st.st_mtime_ns, st.st_size)
                    verdict = judge.judge(lease_id, ttl_s, sig, lambda p=de.path: self._read_lease(p), now)
                    if verdict is None:
                        continue
                    present.add(lease_id)
                    verdicts[lease_id] = (verdict, ttl_s)
                    if verdict is Verdict.DEAD and gc and judge.claim_reap(lease_id):
                        to_reap.append((lease_id, ttl_s, judge.signature(lease_id) or sig))
            judge.forget_missing(present, now)
        for lease_id, ttl_s, sig in to_reap:
            self._reap(lease_id, ttl_s, sig)
        return verdicts

    def _reap(self, lease_id: int, ttl_s: float, sig: Signature) -> None:
        """Deletes a dead lease's entries (under any prefix), then its file; gives up as soon as
        the lease file changed since it was judged (the owner beat after all)."""
        path = self.lease_path(lease_id, ttl_s)

        def unchanged() -> bool:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return True
            return (st.st_ino, st.st_mtime_ns, st.st_size) == sig

        if not unchanged():
            return
        collected = 0
        with os.scandir(self.keys_dir) as it:
            for de in it:
                if de.name.startswith(_TMP):
                    continue
                entry = self.read_entry_path(de.path)
                if entry is None or entry.lease_id != lease_id:
                    continue
                if not unchanged():
                    return
                if self._unlink_if_version(de.path, entry.version):
                    collected += 1
                    logger.info("file discovery collected expired key=%s lease=%016x", entry.key, lease_id)
        if unchanged():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                logger.info("file discovery removed dead lease lease=%016x keys=%d", lease_id, collected)

    @staticmethod
    def _unlink_if_version(path: str, version: tuple[int, int, int]) -> bool:
        """Unlinks ``path`` unless it was rewritten since ``version`` was read (an owner restoring it)."""
        try:
            st = os.stat(path)
            if (st.st_ino, st.st_mtime_ns, st.st_size) == version:
                os.unlink(path)
                return True
        except FileNotFoundError:
            pass
        return False

    def _gc_tmp(self, de: os.DirEntry[str], now: float) -> None:
        if self.judge.tmp_expired(de.path, _TMP_MAX_AGE_S, now):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(de.path)


class _Scanner:
    """Lists visible entries under a prefix, re-reading only files that changed since its last
    scan. One per caller (the shared watch poll has its own), so no entry cache is shared between
    threads; the lease judgements are the store's (``LeaseJudge``), shared by all its scanners."""

    def __init__(self, layout: _Layout) -> None:
        self._layout = layout
        self._cache: dict[str, _Entry] = {}

    def scan(self, prefix: str, own: frozenset[int] = frozenset(), *, gc: bool = True) -> dict[str, _Entry]:
        layout = self._layout
        leases = layout.judge_leases(own, gc=gc)
        judge = layout.judge
        name_prefix = encode_key(prefix) if prefix else ""
        if name_prefix.startswith(_HASHED):  # an over-long prefix: only hashed names can match
            name_prefix = _HASHED
        seen: dict[str, _Entry] = {}
        fresh_cache: dict[str, _Entry] = {}
        orphans: list[tuple[str, _Entry]] = []
        with os.scandir(layout.keys_dir) as it:
            for de in it:
                name = de.name
                if name.startswith(_TMP):
                    if gc:
                        with judge.lock:
                            layout._gc_tmp(de, judge.clock())
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
                if entry.lease_id and entry.lease_id not in own:
                    judged = leases.get(entry.lease_id)
                    if judged is None:
                        orphans.append((de.path, entry))
                        continue
                    if judged[0] is not Verdict.ALIVE:
                        continue  # late or dead: hidden (collected, if dead, by judge_leases)
                seen[entry.key] = entry
        self._cache = fresh_cache
        if gc and orphans:
            self._collect_orphans(orphans)
        return seen

    def _collect_orphans(self, orphans: list[tuple[str, _Entry]]) -> None:
        """Entries whose lease file is missing: collected after twice the lease's TTL, if the file
        is still missing then (an owner that is alive puts both back on its next beat)."""
        layout = self._layout
        judge = layout.judge
        with judge.lock:
            now = judge.clock()
            expired = [
                (path, entry)
                for path, entry in orphans
                if judge.orphan_expired(entry.lease_id, DEFAULT_LEASE_TTL_S, now)
            ]
        for path, entry in expired:
            prefix = f"{entry.lease_id:016x}."
            if any(name.startswith(prefix) for name in os.listdir(layout.leases_dir)):
                continue
            if layout._unlink_if_version(path, entry.version):
                logger.info("file discovery collected orphan key=%s lease=%016x", entry.key, entry.lease_id)


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


class FileLease(KeptAliveLease):
    """A lease of this process, backed by a lease file whose heartbeat counter it advances every
    ttl/3. The id never changes: a lost lease file is re-created under the same id."""

    def __init__(self, store: FileStore, lease_id: int, ttl: float) -> None:
        super().__init__(lease_id, ttl)
        self._store = store
        self.beat = 0
        self.lock = asyncio.Lock()  # a put or delete never races a beat's check of the keys

    async def revoke(self) -> None:
        await self._store._revoke(self)


class FileStore:
    """Discovery in a shared directory on one host.

    ``judge`` is how this store, as a reader, judges other processes' leases (its monotonic clock
    and the owner evidence); the default is right outside tests.
    """

    name = "file"

    def __init__(self, root: str, *, poll_interval_s: float = 0.2, judge: LeaseJudge | None = None) -> None:
        if not root:
            raise DiscoveryError("file discovery needs a directory; set DYN_FILE_KV")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.poll_interval_s = poll_interval_s
        self._layout = _Layout(self.root, judge or LeaseJudge())
        self._leases: list[FileLease] = []
        self._started = False
        self._closed = asyncio.Event()
        # Every watch of this store reads one scan per interval (file_poll), not one scan each.
        self._poll_scanner = _Scanner(self._layout)
        self._poll = SharedPoll(self._poll_scan, poll_interval_s, self._closed)

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
        # One log line per failure episode (and one more if the cause changes), not one per beat:
        # a full disk fails every beat until someone frees space, and the loop keeps trying.
        failing: str | None = None  # the failure's kind while failing
        failed_beats = 0
        while not lease.revoked:
            await asyncio.sleep(lease.ttl / 3)
            try:
                async with lease.lock:
                    if lease.revoked:
                        return
                    await asyncio.to_thread(self._beat_sync, lease, "beat")
            except (OSError, DiscoveryError) as exc:
                kind = "disk_full" if isinstance(exc, DiscoveryDiskFullError) else type(exc).__name__
                if kind != failing:
                    log = logger.error if kind == "disk_full" else logger.warning
                    log("file discovery heartbeat failing lease=%016x cause=%s error=%s", lease.id, kind, exc)
                failing = kind
                failed_beats += 1
                continue
            if failing is not None:
                logger.info("file discovery heartbeat recovered lease=%016x failed_beats=%d", lease.id, failed_beats)
                failing = None
                failed_beats = 0

    def _beat_sync(self, lease: FileLease, why: str) -> None:
        """One beat (call with ``lease.lock`` held): advances the counter, puts back lost keys."""
        lease.beat += 1
        missing, reput, foreign = self._layout.beat(lease.id, lease.ttl, lease.beat, dict(lease.keys))
        for key in foreign:  # another lease's put replaced it, as in etcd: no longer ours
            lease.keys.pop(key, None)
        if missing or reput:
            logger.warning(
                "file discovery lease restored lease=%016x keys_reput=%d reason=%s on=%s",
                lease.id,
                len(reput),
                "lease_file_missing" if missing else "keys_missing",
                why,
            )

    def _put_leased_sync(self, lease: FileLease, key: str, value: bytes) -> None:
        # A put must not land under a lease file that is gone (readers would hide or collect it).
        if not self._layout.lease_exists(lease.id, lease.ttl):
            self._beat_sync(lease, "put")
        self._layout.write_entry(key, value, lease.id)

    async def _revoke(self, lease: FileLease) -> None:
        if not await lease.retire(self._leases):
            return
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
                "file discovery revoke failed lease=%016x error=%s keys_expire_within_s=%g",
                lease.id,
                exc,
                lease.ttl,
            )

    def _own_ids(self) -> frozenset[int]:
        return frozenset(lease.id for lease in self._leases if not lease.revoked)

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
        holder = next((lease for lease in self._leases if key in lease.keys), None)
        if holder is None:
            await self._io(f"delete {key}", self._layout.delete_entry, key)
        else:  # under the lease's lock, or a beat in flight would put the key back
            async with holder.lock:
                await self._io(f"delete {key}", self._layout.delete_entry, key)
                holder.keys.pop(key, None)
        for lease in self._leases:
            lease.keys.pop(key, None)

    async def get(self, key: str) -> bytes | None:
        self._check_open()
        if not key:
            return None
        return await self._io(f"get {key}", self._get_sync, key, self._own_ids())

    def _get_sync(self, key: str, own: frozenset[int]) -> bytes | None:
        path = os.path.join(self._layout.keys_dir, encode_key(key))
        entry = self._layout.read_entry_path(path)
        if entry is None or entry.key != key:
            return None
        if entry.lease_id and entry.lease_id not in own:
            judged = self._layout.judge_leases(own, gc=True).get(entry.lease_id)
            if judged is None or judged[0] is not Verdict.ALIVE:
                return None
        return entry.value

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        self._check_open()
        entries = await self._io(f"get_prefix {prefix}", _Scanner(self._layout).scan, prefix, self._own_ids())
        return {k: e.value for k, e in entries.items()}

    async def list_prefix(self, prefix: str) -> PrefixListing:
        return PrefixListing(prefix, await self.get_prefix(prefix))

    async def watch_prefix(  # type: ignore[override]
        self, prefix: str, *, after: PrefixListing | None = None
    ) -> AsyncIterator[WatchEvent]:
        self._check_open()
        watcher = self._poll.subscribe()
        try:
            read_at = asyncio.get_running_loop().time()
            view = await self._io(f"watch {prefix}", _Scanner(self._layout).scan, prefix, self._own_ids())
            if after is None:
                for key in sorted(view):
                    yield WatchEvent(WatchEventKind.PUT, key, view[key].value)
            else:  # what changed since the listing (no history here: its values against this scan's)
                for ev in diff_events(after.items, {k: e.value for k, e in view.items()}):
                    yield ev
            while True:
                snapshot = await watcher.next(read_at, self._closed)
                if snapshot is None:
                    return
                now = snapshot if not prefix else {k: e for k, e in snapshot.items() if k.startswith(prefix)}
                for key in sorted(view.keys() - now.keys()):
                    yield WatchEvent(WatchEventKind.DELETE, key)
                for key in sorted(now):
                    old = view.get(key)
                    if old is None or old.version != now[key].version:
                        yield WatchEvent(WatchEventKind.PUT, key, now[key].value)
                view = now
        finally:
            self._poll.unsubscribe(watcher)

    def _poll_scan(self) -> dict[str, _Entry]:
        """The shared poll's scan (in a thread): every visible key, with this store's own leases."""
        return self._poll_scanner.scan("", self._own_ids())

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
