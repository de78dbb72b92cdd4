"""Child-process helpers for the request-plane integration tests: a server in its own process
(``serve.py``), started and stopped from the test process, and polling utilities."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from dynamod.shared.transport.plane import ServerAddress

REPO_ROOT = Path(__file__).resolve().parents[4]


class ServerProcess:
    """``serve.py`` in a child process; ``address`` is known once it printed its first line."""

    def __init__(
        self,
        transport: str = "tcp",
        *,
        port: int = 0,
        nats_url: str | None = None,
        max_frame_bytes: int = 1024 * 1024,
        grace_s: float = 10.0,
    ) -> None:
        self.args = [
            sys.executable,
            "-m",
            "tests.integration.request_plane.helpers_transport.serve",
            "--transport",
            transport,
            "--port",
            str(port),
            "--max-frame-bytes",
            str(max_frame_bytes),
            "--grace-s",
            str(grace_s),
        ]
        if nats_url:
            self.args += ["--nats-url", nats_url]
        self.proc: subprocess.Popen[str] | None = None
        self.address: ServerAddress | None = None
        self._selector: selectors.BaseSelector | None = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def start(self, timeout: float = 20.0) -> ServerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.args, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=None, text=True, env=env
        )
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        line = self.read_line(timeout)
        self.address = ServerAddress(line["transport"], line["address"])
        return self

    def read_line(self, timeout: float) -> dict[str, Any]:
        """The next JSON line the server printed, waiting at most ``timeout``."""
        assert self.proc is not None and self.proc.stdout is not None and self._selector is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"server process printed nothing within {timeout}s")
            if self._selector.select(left):
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"server process exited with {self.proc.wait()} before printing")
                return json.loads(line)

    def terminate(self) -> None:
        """SIGTERM: the server stops gracefully."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._selector is not None:
            self._selector.close()


async def wait_for(
    predicate: Callable[[], Awaitable[Any]], timeout: float, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Polls an async ``predicate`` until it returns something truthy or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last value {last!r}")


async def collect(stream: AsyncIterator[object]) -> list[object]:
    """Everything a response stream yields, in order."""
    return [item async for item in stream]


async def stats(client: Any, address: ServerAddress) -> dict[str, Any]:
    """What the helper server's handlers saw (see ``serve.py``)."""
    items = [item async for item in client.stream(address, "test/stats", None, timeout_s=5)]
    assert len(items) == 1, items
    return items[0]
