"""A child's log file that rotates by size, fed from the child's stdout/stderr pipe.

Why a pipe and not copy-truncate: with copy-truncate the child writes the file itself and the
supervisor copies it away and truncates it when it passes the limit, so every line written between
the copy and the truncate is lost, and a rotation can cut a line in two. Here the supervisor owns
the file: the child writes to a pipe, and one thread per run (``LogPump``) reads it and appends to
``RotatingLog``, which rolls over at a line boundary (``name.log`` -> ``name.log.1`` -> ... ->
``name.log.<backups>``; the oldest is dropped). Nothing is lost on rotation, the file never holds
half a line at its start, and the pump keeps the run's last lines in memory, so a crash report
shows the current run's end even if the log rotated (or the disk filled) during the run.

The cost is one reader thread per child and that the child's output passes through the supervisor;
children die with the supervisor anyway (``PR_SET_PDEATHSIG``), so nobody is left writing into a
pipe without a reader. A full disk does not block a child: the pump keeps draining the pipe, drops
what it cannot write, logs that once per episode, and writes a line saying how much was lost when
writing works again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import deque
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 50 * 1024 * 1024
DEFAULT_BACKUPS = 3
_READ_CHUNK = 64 * 1024
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def parse_size(text: str) -> int:
    """``52428800``, ``50M``, ``50MiB``, ``512k``, ``1G`` -> bytes (binary units); ``0`` = no limit."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    for suffix, factor in (("k", 1024), ("m", 1024**2), ("g", 1024**3)):
        if s.endswith(suffix):
            s, scale = s[:-1], factor
            break
    try:
        value = float(s) * scale
    except ValueError:
        raise ValueError(f"not a size: {text!r} (bytes, or with K, M or G)") from None
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(value)


class RotatingLog:
    """Append-only log file that rolls over before a write would take it past ``max_bytes``
    (``0``: never), at a line boundary, keeping ``backups`` old files (``0``: the file starts over).

    Thread-safe: a run's pump and a previous run's (still draining a grandchild's output) share it.
    """

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self.dropped_bytes = 0  # lost to a full disk in the current episode
        self._lock = threading.Lock()
        self._file = open(path, "ab")  # noqa: SIM115 - lives as long as the supervisor
        self._size = os.fstat(self._file.fileno()).st_size
        self._at_line_start = True
        self._closed = False

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._closed or not data:
                return
            try:
                if self.dropped_bytes:
                    self._append(f"[dynamod up: {self.dropped_bytes} bytes of output lost: disk full]\n".encode())
                    self.dropped_bytes = 0
                    logger.info("child log writable again path=%s", self.path)
                self._write_rotating(data)
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                if not self.dropped_bytes:
                    logger.error(
                        "child log write failing path=%s error=disk_full (%s): output is dropped until there is "
                        "space again; the child keeps running", self.path, exc.strerror,
                    )
                self.dropped_bytes += len(data)

    def _write_rotating(self, data: bytes) -> None:
        """Appends ``data``, rolling over between lines so that a file passes ``max_bytes`` only by
        the end of a line it had begun (or by a single line longer than the limit)."""
        while data:
            room = self.max_bytes - self._size
            if not self.max_bytes or len(data) <= room:
                self._append(data)
                return
            if self._at_line_start:
                cut = data.rfind(b"\n", 0, room) + 1 if room > 0 else 0  # the whole lines that fit
                self._append(data[:cut])
                data = data[cut:]
                if self._size:
                    self._rotate()
                    continue
            nl = data.find(b"\n") + 1  # a line begun (or one longer than the limit) ends here
            if not nl:
                self._append(data)
                return
            self._append(data[:nl])
            data = data[nl:]

    def _append(self, data: bytes) -> None:
        if not data:
            return
        self._file.write(data)
        self._file.flush()
        self._size += len(data)
        self._at_line_start = data.endswith(b"\n")

    def _rotate(self) -> None:
        self._file.close()
        if self.backups > 0:
            for n in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{n}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            self._file = open(self.path, "ab")  # noqa: SIM115
        else:
            self._file = open(self.path, "wb")  # noqa: SIM115
        self._size = 0
        self._at_line_start = True
        self.rotations += 1

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(OSError):
                    self._file.close()


class LogPump:
    """Copies one run's output from the read end of its pipe into ``log``, keeping the run's last
    ``tail_lines`` lines in memory. Ends (and closes the pipe) at EOF: when the child and every
    process that inherited its output are gone."""

    def __init__(self, read_fd: int, log: RotatingLog, name: str, tail_lines: int) -> None:
        self._fd = read_fd
        self._log = log
        self._tail: deque[bytes] = deque(maxlen=tail_lines)
        self._partial = b""
        self._tail_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"log-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self._fd, _READ_CHUNK)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                self._remember(data)
                try:
                    self._log.write(data)
                except OSError as exc:  # not a full disk (handled inside): say so, keep draining
                    logger.warning("child log write failed path=%s error=%s", self._log.path, exc)
        finally:
            os.close(self._fd)

    def _remember(self, data: bytes) -> None:
        with self._tail_lock:
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()[-_READ_CHUNK:]  # a line still being written
            self._tail.extend(lines[-(self._tail.maxlen or 1) :])

    def tail(self) -> list[str]:
        """The run's last lines (an unfinished last line included)."""
        with self._tail_lock:
            lines = list(self._tail) + ([self._partial] if self._partial else [])
        keep = self._tail.maxlen or len(lines)
        return [line.decode("utf-8", errors="replace").rstrip("\r") for line in lines[-keep:]]

    def join(self, timeout_s: float) -> bool:
        """Waits for EOF (the output drained); False if something still holds the pipe open."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
