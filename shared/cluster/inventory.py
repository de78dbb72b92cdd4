"""The SSH inventory (TOML): hosts, how to reach them, and which dynamod roles run where.

Example (deploy/inventory/cluster.example.toml has a full one)::

    [cluster]
    namespace = "dynamo"
    discovery = "etcd"                     # or "file" for a single host
    etcd_endpoints = ["http://10.0.0.1:2379"]
    nats_server = "nats://10.0.0.1:4222"
    dynamod = "/opt/dynamod/venv/bin/dynamod"
    workdir = "/var/lib/dynamod"
    supervisor = "auto"                    # auto | systemd | process

    [ssh]
    user = "dynamo"
    key = "~/.ssh/id_ed25519"

    [[hosts]]
    name = "gpu-a"
    address = "10.0.0.11"                  # SSH reaches it here; its roles bind and advertise it too
    # cluster_address = "192.168.1.11"     # when the cluster network is another than SSH's
      [[hosts.roles]]
      role = "agg"
      args = ["--engine", "vllm", "--model", "/models/llama"]
      system_port = 9091

Every error names the file and the field, so a typo is one line to fix.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.settings import SECRET_FILE_VARS, SECRET_VALUE_VARS

ROLES = ("agg", "decode", "prefill", "frontend", "router", "planner", "global-router", "up")
SUPERVISORS = ("auto", "systemd", "process")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(slots=True)
class SshSettings:
    user: str = ""
    key: str | None = None
    port: int = 22
    known_hosts: str | None = None  # a path; "none" disables host key checking (test rigs only)
    connect_timeout_s: float = 10.0


@dataclass(slots=True)
class RoleSpec:
    role: str
    name: str  # unique per host: unit name dynamod-<name>, pid file <name>.pid
    args: list[str] = field(default_factory=list)
    system_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return f"dynamod-{self.name}"


@dataclass(slots=True)
class HostSpec:
    name: str
    address: str  # where SSH reaches the host
    ssh: SshSettings
    roles: list[RoleSpec] = field(default_factory=list)
    cluster_address: str | None = None  # where the other hosts reach its roles; None: ``address``

    @property
    def listen_address(self) -> str:
        """The address this host's roles bind and advertise (``--host``, ``--http-host``,
        ``--system-host``): the other hosts dial it, so it is never a loopback default."""
        return self.cluster_address or self.address


@dataclass(slots=True)
class ClusterSpec:
    namespace: str = "dynamo"
    discovery: str = "etcd"
    etcd_endpoints: list[str] = field(default_factory=list)
    nats_server: str | None = None
    file_kv: str | None = None
    event_plane: str | None = None
    dynamod: str = "dynamod"  # the dynamod executable on the hosts (a venv's bin/dynamod)
    python: str = "python3"  # any Python 3 on the hosts: runs the /health check there
    workdir: str = "/tmp/dynamod-cluster"
    supervisor: str = "auto"
    env: dict[str, str] = field(default_factory=dict)
    # DYN_*_FILE variable -> a file on this machine: copied over SSH (stdin, never argv) to
    # <workdir>/secrets/ on every host, mode 0600, and the variable set to that path for every role.
    secret_files: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Inventory:
    path: str
    cluster: ClusterSpec
    hosts: list[HostSpec]

    def select(self, host: str | None = None, role: str | None = None) -> list[tuple[HostSpec, list[RoleSpec]]]:
        """Hosts (and their roles) matching ``--host`` / ``--role`` (a role name or a role's name)."""
        out = []
        for h in self.hosts:
            if host and h.name != host and h.address != host:
                continue
            roles = [r for r in h.roles if not role or role in (r.role, r.name)]
            if roles:
                out.append((h, roles))
        if not out:
            what = " and ".join(x for x in (f"host {host!r}" if host else "", f"role {role!r}" if role else "") if x)
            raise ConfigError(f"{self.path}: nothing matches {what or 'the inventory'}")
        return out


def _expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where} must be a {names}, got {value!r}")
    return value


def _str_list(value: Any, where: str) -> list[str]:
    _expect(value, list, where)
    for i, item in enumerate(value):
        _expect(item, (str, int, float), f"{where}[{i}]")
    return [str(v) for v in value]


def _str_map(value: Any, where: str) -> dict[str, str]:
    _expect(value, dict, where)
    return {str(k): str(v) for k, v in value.items()}


def _known_fields(raw: dict[str, Any], known: set[str], where: str) -> None:
    """Refuses a table with a field the inventory does not have (a typo must not pass silently)."""
    extra = set(raw) - known
    if extra:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(extra))}; known: {', '.join(sorted(known))}")


def _ssh(raw: dict[str, Any], base: SshSettings, where: str) -> SshSettings:
    _known_fields(raw, {"user", "key", "port", "known_hosts", "connect_timeout_s"}, where)
    s = SshSettings(base.user, base.key, base.port, base.known_hosts, base.connect_timeout_s)
    if "user" in raw:
        s.user = _expect(raw["user"], str, f"{where}.user")
    if "key" in raw:
        s.key = os.path.expanduser(_expect(raw["key"], str, f"{where}.key"))
    if "port" in raw:
        s.port = int(_expect(raw["port"], int, f"{where}.port"))
    if "known_hosts" in raw:
        kh = _expect(raw["known_hosts"], str, f"{where}.known_hosts")
        s.known_hosts = kh if kh == "none" else os.path.expanduser(kh)
    if "connect_timeout_s" in raw:
        s.connect_timeout_s = float(_expect(raw["connect_timeout_s"], (int, float), f"{where}.connect_timeout_s"))
    return s


def _no_secret_values(env: dict[str, str], where: str) -> dict[str, str]:
    """Refuses a secret's value in ``env``: roles start as ``env K=V dynamod ...`` (or with systemd's
    ``--setenv``), which every user of the host can read in ``ps`` or ``systemctl show``."""
    found = sorted(set(env) & SECRET_VALUE_VARS)
    if found:
        raise ConfigError(
            f"{where}: {', '.join(found)} would put a secret on the hosts' command lines (visible in ps); "
            f"name a file instead: cluster.secret_files = {{ {found[0]}_FILE = \"path/on/this/machine\" }}"
        )
    return env


def _secret_files(raw: Any, where: str) -> dict[str, str]:
    files = _str_map(raw, where)
    out: dict[str, str] = {}
    for var, local in files.items():
        if var not in SECRET_FILE_VARS:
            raise ConfigError(f"{where}: {var} is not one of {', '.join(sorted(SECRET_FILE_VARS))}")
        path = os.path.expanduser(local)
        if not os.path.isfile(path):
            raise ConfigError(f"{where}.{var}: {local!r} is not a file on this machine")
        out[var] = path
    return out


def parse_inventory(data: dict[str, Any], path: str = "<inventory>") -> Inventory:
    top_known = {"cluster", "ssh", "hosts"}
    extra = set(data) - top_known
    if extra:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(sorted(extra))}; expected cluster, ssh, hosts")
    c_raw = _expect(data.get("cluster", {}), dict, f"{path}: [cluster]")
    c = ClusterSpec()
    c_known = {"namespace", "discovery", "etcd_endpoints", "nats_server", "file_kv", "event_plane", "dynamod", "python", "workdir", "supervisor", "env", "secret_files"}
    _known_fields(c_raw, c_known, f"{path}: [cluster]")
    for key in ("namespace", "discovery", "nats_server", "file_kv", "event_plane", "dynamod", "python", "workdir", "supervisor"):
        if key in c_raw:
            setattr(c, key, _expect(c_raw[key], str, f"{path}: cluster.{key}"))
    if "etcd_endpoints" in c_raw:
        c.etcd_endpoints = _str_list(c_raw["etcd_endpoints"], f"{path}: cluster.etcd_endpoints")
    if "env" in c_raw:
        c.env = _no_secret_values(_str_map(c_raw["env"], f"{path}: cluster.env"), f"{path}: cluster.env")
    if "secret_files" in c_raw:
        c.secret_files = _secret_files(c_raw["secret_files"], f"{path}: cluster.secret_files")
    if c.discovery not in ("etcd", "file"):
        raise ConfigError(f"{path}: cluster.discovery must be etcd or file, got {c.discovery!r}")
    if c.supervisor not in SUPERVISORS:
        raise ConfigError(f"{path}: cluster.supervisor must be one of {', '.join(SUPERVISORS)}, got {c.supervisor!r}")
    base_ssh = _ssh(_expect(data.get("ssh", {}), dict, f"{path}: [ssh]"), SshSettings(user=os.environ.get("USER", "root")), f"{path}: ssh")
    hosts_raw = _expect(data.get("hosts", []), list, f"{path}: [[hosts]]")
    if not hosts_raw:
        raise ConfigError(f"{path}: no [[hosts]] defined")
    hosts: list[HostSpec] = []
    seen_hosts: set[str] = set()
    for i, h in enumerate(hosts_raw):
        where = f"{path}: hosts[{i}]"
        _expect(h, dict, where)
        _known_fields(h, {"name", "address", "cluster_address", "ssh", "roles"}, where)
        address = _expect(h.get("address"), str, f"{where}.address")
        cluster_address = h.get("cluster_address")
        if cluster_address is not None:
            cluster_address = _expect(cluster_address, str, f"{where}.cluster_address")
        for field_name, value in (("address", address), ("cluster_address", cluster_address)):
            if value is not None and value.strip() in ("", "0.0.0.0", "::"):
                raise ConfigError(f"{where}.{field_name} must be an address the other hosts can dial, got {value!r}")
        name = _expect(h.get("name", address), str, f"{where}.name")
        if name in seen_hosts:
            raise ConfigError(f"{where}: duplicate host name {name!r}")
        seen_hosts.add(name)
        ssh = _ssh(_expect(h.get("ssh", {}), dict, f"{where}.ssh"), base_ssh, f"{where}.ssh")
        roles: list[RoleSpec] = []
        seen_roles: set[str] = set()
        for j, r in enumerate(_expect(h.get("roles", []), list, f"{where}.roles")):
            rwhere = f"{where}.roles[{j}]"
            _expect(r, dict, rwhere)
            _known_fields(r, {"role", "name", "args", "system_port", "env"}, rwhere)
            role = _expect(r.get("role"), str, f"{rwhere}.role")
            if role not in ROLES:
                raise ConfigError(f"{rwhere}.role must be one of {', '.join(ROLES)}, got {role!r}")
            rname = _expect(r.get("name", role), str, f"{rwhere}.name")
            if not _NAME_RE.match(rname):
                raise ConfigError(f"{rwhere}.name {rname!r} must be letters, digits, '-', '_' or '.'")
            if rname in seen_roles:
                raise ConfigError(f"{rwhere}: two roles named {rname!r} on host {name}; give one a distinct name")
            seen_roles.add(rname)
            port = r.get("system_port")
            if port is not None:
                _expect(port, int, f"{rwhere}.system_port")
            roles.append(
                RoleSpec(
                    role=role,
                    name=rname,
                    args=_str_list(r.get("args", []), f"{rwhere}.args"),
                    system_port=port,
                    env=_no_secret_values(_str_map(r.get("env", {}), f"{rwhere}.env"), f"{rwhere}.env"),
                )
            )
        hosts.append(HostSpec(name, address, ssh, roles, cluster_address))
    return Inventory(path, c, hosts)


def load_inventory(path: str | Path) -> Inventory:
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"inventory {p} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"inventory {p} is not valid TOML: {exc}") from None
    return parse_inventory(data, str(p))
