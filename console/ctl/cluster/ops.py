"""``dynamoctl cluster up|down|status|logs``: one operation on every selected host.

The inventory, the SSH session and the steps on one role live in ``shared/cluster`` (the planner's
SSH connector starts and stops workers with the same code); this module fans them out over hosts
and makes the rows ``dynamoctl`` prints.

Hosts run in parallel; the roles of a host run in inventory order for ``up`` and in reverse for
``down``, so listing the frontend first means it starts first and stops last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from dynamod.shared.cluster import commands as cmds
from dynamod.shared.cluster.inventory import ClusterSpec, HostSpec, Inventory, RoleSpec
from dynamod.shared.cluster.roles import (
    parse_state,
    role_health,
    role_mode,
    role_status,
    start_role,
    stop_role,
)
from dynamod.shared.cluster.ssh import HostSession, SshError

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

    def row(self) -> tuple[str, ...]:
        """The ``dynamoctl cluster`` table row: DETAIL whole (an SSH error cut at 80 columns lost
        its end, "connection refused (is sshd running on that port?"), on one line."""
        detail = " ".join(self.detail.split())
        return (self.host, self.name, self.role, self.mode, self.state, str(self.pid or "-"), self.health, detail)

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
        started = await start_role(session, cluster, role)
        st.mode, st.state, st.pid, st.detail = started.mode, started.state, started.pid, started.detail
        if st.state == "error":
            continue
        logger.info("role started host=%s name=%s mode=%s state=%s pid=%d", session.host.name, role.name, st.mode, st.state, st.pid)
    deadline = time.monotonic() + wait_s
    for role, st in zip(roles, out, strict=True):
        if st.state == "error" or role.system_port is None:
            continue
        while True:
            st.health, st.detail = await role_health(session, cluster, role)
            if st.health == "ok" or time.monotonic() >= deadline:
                break
            state, _ = parse_state((await session.run(cmds.status_command(cluster, role, st.mode))).stdout)
            if state == "failed":
                st.detail = "the unit failed; see `dynamoctl cluster logs`"
                break
            await asyncio.sleep(HEALTH_POLL_S)
        if st.health != "ok":
            st.detail = st.detail or f"/health not ready after {wait_s:g}s"


async def _down(session: HostSession, cluster: ClusterSpec, roles: list[RoleSpec], out: list[RoleStatus]) -> None:
    for role, st in reversed(list(zip(roles, out, strict=True))):
        stopped = await stop_role(session, cluster, role)
        st.mode, st.state, st.detail = stopped.mode, stopped.state, stopped.detail


async def _status(session: HostSession, cluster: ClusterSpec, roles: list[RoleSpec], out: list[RoleStatus]) -> None:
    for role, st in zip(roles, out, strict=True):
        found = await role_status(session, cluster, role)
        st.mode, st.state, st.pid = found.mode, found.state, found.pid
        if st.state == "running":
            st.health, st.detail = await role_health(session, cluster, role)


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
                    mode = await role_mode(session, inv.cluster, r)
                    res = await session.run(cmds.logs_command(inv.cluster, r, mode, lines))
                    out.append((h.name, r.name, res.stdout))
                return out
        except SshError as exc:
            return [(h.name, r.name, f"error: {exc}\n") for r in roles]

    results = await asyncio.gather(*(one(h, rs) for h, rs in inv.select(host, role)))
    return [item for group in results for item in group]
