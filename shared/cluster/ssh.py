"""A thin asyncssh wrapper: connect to an inventory host and run shell commands on it.

Errors become ``SshError`` with the host and the reason in one line (bad key, refused, timeout,
unknown host key), which is what ``dynamoctl cluster`` prints and the planner's SSH connector logs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import asyncssh

from dynamod.shared.cluster.inventory import HostSpec
from dynamod.shared.errors import DynamoError

logger = logging.getLogger(__name__)


class SshError(DynamoError):
    code = "ssh_error"
    http_status = 502


@dataclass(slots=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str


class HostSession:
    """One SSH connection to one host; use ``async with HostSession(host) as s: await s.run(...)``."""

    def __init__(self, host: HostSpec) -> None:
        self.host = host
        self._conn: asyncssh.SSHClientConnection | None = None

    @property
    def label(self) -> str:
        s = self.host.ssh
        return f"{s.user}@{self.host.address}:{s.port}"

    async def __aenter__(self) -> HostSession:
        s = self.host.ssh
        known_hosts: object = None if s.known_hosts == "none" else (s.known_hosts or ())
        try:
            self._conn = await asyncio.wait_for(
                asyncssh.connect(
                    self.host.address,
                    port=s.port,
                    username=s.user,
                    client_keys=[s.key] if s.key else None,
                    known_hosts=known_hosts,  # type: ignore[arg-type]
                    agent_path=None if s.key else (),
                ),
                timeout=s.connect_timeout_s,
            )
        except TimeoutError:
            raise SshError(f"ssh {self.label} ({self.host.name}): no answer within {s.connect_timeout_s:g}s") from None
        except (OSError, asyncssh.Error) as exc:
            raise SshError(f"ssh {self.label} ({self.host.name}): {_describe(exc)}") from None
        logger.info("ssh connected host=%s address=%s", self.host.name, self.label)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.close()
            await self._conn.wait_closed()
            self._conn = None

    async def run(self, command: str, *, timeout_s: float = 60.0, stdin: str | None = None) -> CommandResult:
        """Runs ``command``; ``stdin`` is how a secret reaches the host (never in ``command``)."""
        assert self._conn is not None, "use HostSession as an async context manager"
        try:
            res = await asyncio.wait_for(self._conn.run(command, check=False, input=stdin), timeout=timeout_s)
        except TimeoutError:
            raise SshError(f"ssh {self.label}: command timed out after {timeout_s:g}s") from None
        except (OSError, asyncssh.Error) as exc:
            raise SshError(f"ssh {self.label}: {_describe(exc)}") from None
        out = res.stdout if isinstance(res.stdout, str) else (res.stdout or b"").decode(errors="replace")
        err = res.stderr if isinstance(res.stderr, str) else (res.stderr or b"").decode(errors="replace")
        return CommandResult(res.exit_status if res.exit_status is not None else 255, out, err)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncssh.PermissionDenied):
        return "permission denied (check ssh.user and ssh.key)"
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return f"host key not verifiable ({exc.reason}); add it to ssh.known_hosts"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is sshd running on that port?)"
    if isinstance(exc, asyncssh.Error):
        return exc.reason or type(exc).__name__
    return str(exc) or type(exc).__name__
