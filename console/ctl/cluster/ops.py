"""``dynamoctl cluster up|down|status|logs``: one operation on every selected host.

Hosts run in parallel; the roles of a host run in inventory order for ``up`` and in reverse for
``down``, so listing the frontend first means it starts first and stops last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from dynamod.console.ctl.cluster import commands as cmds
from dynamod.console.ctl.cluster.inventory import ClusterSpec, HostSpec, Inventory, RoleSpec
from dynamod.console.ctl.cluster.ssh import HostSession, SshError

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5


@dataclass(slots=True)
class RoleStatus:
    host: str
    name: str
    role: str
    mode: str = "-"
    state: str = "-"  # running | stopped | failed | started | already running | error
    pid: int = 0
    health: str = "-"  # ok | fail | - (no system_port)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.state != "error" and self.health != "fail"

    def to_dict(self) -> dict[str, object]:
        return {
            "host": self.host,
            "name": self.name,
            "role": self.role,
            "mode": self.mode,
            "state": self.state,
            "pid": self.pid,
            "health": self.health,
            "detail": self.detail,
        }


async def _mode(session: HostSession, cluster: ClusterSpec, role: RoleSpec) -> str:
    if cluster.supervisor == "process":
        return cmds.MODE_PROCESS
    res = await session.run(cmds.mode_command(cluster, role))
    detected = res.stdout.strip() or cmds.MODE_PROCESS
    if cluster.supervisor == "systemd" and detected == cmds.MODE_PROCESS:
        raise SshError(f"{session.host.name}: cluster.supervisor is systemd but the host has no usable systemd")
    return detected


def _parse_state(line: str) -> tuple[str, int]:
    parts = line.strip().split()
    if not parts:
        return "unknown", 0
    pid = int(parts[-1]) if parts[-1].isdigit() else 0
    word = " ".join(p for p in parts if not p.isdigit())
    return word, pid


async def _health(session: HostSession, cluster: ClusterSpec, role: RoleSpec) -> tuple[str, str]:
    if role.system_port is None:
        return "-", ""
    res = await session.run(cmds.health_command(cluster, role), timeout_s=15)
    return ("ok" if res.rc == 0 else "fail"), res.stdout.strip()[:200]


async def _per_host(inv: Inventory, host: HostSpec, roles: list[RoleSpec], op: str, **kw: object) -> list[RoleStatus]:
    out = [RoleStatus(host.name, r.name, r.role) for r in roles]
    try:
        async with HostSession(host) as session:
            if op == "up":
                await _up(session, inv.cluster, roles, out, float(kw.get("wait_s", 60.0)))  # type: ignore[arg-type]
            elif op == "down":
                await _down(session, inv.cluster, roles, out)
            else:
                await _status(session, inv.cluster, roles, out)
    except SshError as exc:
        for st in out:
            if st.state in ("-", "started"):
                st.state = "error"
                st.detail = str(exc)
    return out


async def _up(session: HostSession, cluster: ClusterSpec, roles: list[RoleSpec], out: list[RoleStatus], wait_s: float) -> None:
    for role, st in zip(roles, out, strict=True):
        st.mode = await _mode(session, cluster, role)
        res = await session.run(cmds.start_command(cluster, role, st.mode))
        if res.rc != 0:
            st.state, st.detail = "error", (res.stderr or res.stdout).strip()[:300]
            continue
        st.state, st.pid = _parse_state(res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "")
        logger.info("role started host=%s name=%s mode=%s state=%s pid=%d", session.host.name, role.name, st.mode, st.state, st.pid)
    deadline = time.monotonic() + wait_s
    for role, st in zip(roles, out, strict=True):
        if st.state == "error" or role.system_port is None:
            continue
        while True:
            st.health, st.detail = await _health(session, cluster, role)
            if st.health == "ok" or time.monotonic() >= deadline:
                break
            state, _ = _parse_state((await session.run(cmds.status_command(cluster, role, st.mode))).stdout)
            if state == "failed":
                st.detail = "the unit failed; see `dynamoctl cluster logs`"
                break
            await asyncio.sleep(HEALTH_POLL_S)
        if st.health != "ok":
            st.detail = st.detail or f"/health not ready after {wait_s:g}s"


async def _down(session: HostSession, cluster: ClusterSpec, roles: list[RoleSpec], out: list[RoleStatus]) -> None:
    for role, st in reversed(list(zip(roles, out, strict=True))):
        st.mode = await _mode(session, cluster, role)
        res = await session.run(cmds.stop_command(cluster, role, st.mode), timeout_s=cmds.STOP_TIMEOUT_S + 30)
        if res.rc != 0:
            st.state, st.detail = "error", (res.stderr or res.stdout).strip()[:300]
        else:
            st.state = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "stopped"


async def _status(session: HostSession, cluster: ClusterSpec, roles: list[RoleSpec], out: list[RoleStatus]) -> None:
    for role, st in zip(roles, out, strict=True):
        st.mode = await _mode(session, cluster, role)
        st.state, st.pid = _parse_state((await session.run(cmds.status_command(cluster, role, st.mode))).stdout)
        if st.state == "running":
            st.health, st.detail = await _health(session, cluster, role)


async def run_op(inv: Inventory, op: str, *, host: str | None = None, role: str | None = None, wait_s: float = 60.0) -> list[RoleStatus]:
    """``op`` is up, down or status. Never raises for one host's failure: it is in that host's rows."""
    selected = inv.select(host, role)
    results = await asyncio.gather(*(_per_host(inv, h, rs, op, wait_s=wait_s) for h, rs in selected))
    return [st for host_results in results for st in host_results]


async def gather_logs(inv: Inventory, *, host: str | None = None, role: str | None = None, lines: int = 100) -> list[tuple[str, str, str]]:
    """(host, role name, text) for every selected role; an unreachable host gives its error as text."""

    async def one(h: HostSpec, roles: list[RoleSpec]) -> list[tuple[str, str, str]]:
        try:
            async with HostSession(h) as session:
                out = []
                for r in roles:
                    mode = await _mode(session, inv.cluster, r)
                    res = await session.run(cmds.logs_command(inv.cluster, r, mode, lines))
                    out.append((h.name, r.name, res.stdout))
                return out
        except SshError as exc:
            return [(h.name, r.name, f"error: {exc}\n") for r in roles]

    results = await asyncio.gather(*(one(h, rs) for h, rs in inv.select(host, role)))
    return [item for group in results for item in group]
