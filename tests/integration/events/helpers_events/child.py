"""Drives ``publisher_main.py`` in a child process from an async test."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("publisher_main.py")


class PublisherProcess:
    """A publisher in another process; ``call`` sends one command and returns its JSON answer."""

    def __init__(self, *args: str) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="dynamod-event-child-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.info: dict[str, Any] = {}

    async def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        except TimeoutError:
            raise AssertionError(f"child gave no answer within {timeout}s; log:\n{self.log()}") from None
        if not line:
            raise AssertionError(f"child exited ({self.proc.poll()}); log:\n{self.log()}")
        return json.loads(line)

    async def ready(self, timeout: float = 20.0) -> dict[str, Any]:
        self.info = await self._read(timeout)
        assert self.info.get("ready"), self.info
        return self.info

    async def call(self, timeout: float = 20.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = await self._read(timeout)
        assert answer.get("ok"), answer
        return answer

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> int | None:
        """Asks the child to exit, then kills it if it does not; returns its exit code."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
        return self.proc.returncode
