"""One role on one host, over an open ``HostSession``: start it, stop it, ask how it is.

These are the steps ``dynamoctl cluster up|down|status`` runs for every selected role and the
planner's SSH connector runs for the one worker it adds or removes, so both judge "running" and
"healthy" the same way. How a role runs (systemd unit or supervised process) is detected on the
host the first time and remembered there (``commands.mode_command``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from dynamod.shared.cluster import commands as cmds
from dynamod.shared.cluster.inventory import ClusterSpec, RoleSpec
from dynamod.shared.cluster.ssh import HostSession, SshError

HEALTH_TIMEOUT_S = 15.0


@dataclass(slots=True)
class RoleState:
    """What a start, stop or status step found: ``state`` is one of running, stopped, failed,
    started, already running, not running, killed, error."""

    mode: str
    state: str
    pid: int = 0
    detail: str = ""


def parse_state(line: str) -> tuple[str, int]:
    """``"already running 123"`` -> ``("already running", 123)``."""
    parts = line.strip().split()
    if not parts:
        return "unknown", 0
    pid = int(parts[-1]) if parts[-1].isdigit() else 0
    word = " ".join(p for p in parts if not p.isdigit())
    return word, pid


async def role_mode(session: HostSession, cluster: ClusterSpec, role: RoleSpec) -> str:
    if cluster.supervisor == "process":
        return cmds.MODE_PROCESS
    res = await session.run(cmds.mode_command(cluster, role))
    detected = res.stdout.strip() or cmds.MODE_PROCESS
    if cluster.supervisor == "systemd" and detected == cmds.MODE_PROCESS:
        raise SshError(f"{session.host.name}: cluster.supervisor is systemd but the host has no usable systemd")
    return detected


def last_lines(text: str, limit: int = 600) -> str:
    """A remote command's error output for a one-line report: its last whole lines (where a
    traceback or a shell says what went wrong) up to ``limit`` characters, joined with `` | ``;
    never cut mid-sentence, and "..." in front when earlier lines were left out."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        if kept and size + len(line) + 3 > limit:
            break
        kept.insert(0, line)
        size += len(line) + 3
    return ("... | " if len(kept) < len(lines) else "") + " | ".join(kept)


async def role_health(session: HostSession, cluster: ClusterSpec, role: RoleSpec) -> tuple[str, str]:
    """(``ok`` | ``fail`` | ``-`` without a system port, the /health body or error)."""
    if role.system_port is None:
        return "-", ""
    res = await session.run(cmds.health_command(cluster, role, session.host), timeout_s=HEALTH_TIMEOUT_S)
    return ("ok" if res.rc == 0 else "fail"), res.stdout.strip()[:200]


async def upload_secret_files(session: HostSession, cluster: ClusterSpec) -> None:
    """Copies ``cluster.secret_files`` to the host (over the SSH channel's stdin, so no secret is
    ever on a command line); the roles find them through ``commands.secret_file_env``."""
    for var, local in cluster.secret_files.items():
        content = await asyncio.to_thread(Path(local).read_text, encoding="utf-8")
        res = await session.run(cmds.upload_secret_command(cluster, var), stdin=content)
        if res.rc != 0:
            raise SshError(f"cannot write {var} on {session.host.name}: {last_lines(res.stderr or res.stdout)}")


async def start_role(session: HostSession, cluster: ClusterSpec, role: RoleSpec, mode: str | None = None) -> RoleState:
    """Starts ``role`` unless it already runs (``started`` / ``already running`` / ``error``)."""
    mode = mode or await role_mode(session, cluster, role)
    try:
        await upload_secret_files(session, cluster)
    except (OSError, UnicodeDecodeError, SshError) as exc:
        return RoleState(mode, "error", detail=f"secret files: {exc}")
    res = await session.run(cmds.start_command(cluster, role, mode, session.host))
    if res.rc != 0:
        return RoleState(mode, "error", detail=last_lines(res.stderr or res.stdout))
    out = res.stdout.strip()
    state, pid = parse_state(out.splitlines()[-1] if out else "")
    return RoleState(mode, state, pid)


async def stop_role(session: HostSession, cluster: ClusterSpec, role: RoleSpec, mode: str | None = None) -> RoleState:
    """Stops ``role``: SIGTERM, whose graceful path lets in-flight requests finish, then SIGKILL
    after ``commands.STOP_TIMEOUT_S`` (``stopped`` / ``killed`` / ``not running`` / ``error``)."""
    mode = mode or await role_mode(session, cluster, role)
    res = await session.run(cmds.stop_command(cluster, role, mode), timeout_s=cmds.STOP_TIMEOUT_S + 30)
    if res.rc != 0:
        return RoleState(mode, "error", detail=last_lines(res.stderr or res.stdout))
    out = res.stdout.strip()
    return RoleState(mode, out.splitlines()[-1] if out else "stopped")


async def role_status(session: HostSession, cluster: ClusterSpec, role: RoleSpec, mode: str | None = None) -> RoleState:
    """``running`` (with its pid), ``stopped`` or ``failed``."""
    mode = mode or await role_mode(session, cluster, role)
    state, pid = parse_state((await session.run(cmds.status_command(cluster, role, mode))).stdout)
    return RoleState(mode, state, pid)
