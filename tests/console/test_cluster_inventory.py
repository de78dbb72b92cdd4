"""Inventory parsing and the shell commands dynamoctl cluster builds: errors an operator can fix
from one line, and commands that quote everything and supervise the role."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from dynamod.console.ctl.cluster import commands as cmds
from dynamod.console.ctl.cluster.inventory import load_inventory, parse_inventory
from dynamod.shared.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "inventory" / "cluster.example.toml"


def _inv(**over):
    data = {
        "cluster": {"namespace": "prod", "discovery": "etcd", "etcd_endpoints": ["http://10.0.0.1:2379"],
                    "nats_server": "nats://10.0.0.1:4222", "dynamod": "/opt/venv/bin/dynamod", "workdir": "/var/lib/dynamod"},
        "ssh": {"user": "dynamo", "key": "~/.ssh/id"},
        "hosts": [{"name": "a", "address": "10.0.0.11", "roles": [
            {"role": "frontend", "args": ["--http-port", "8000"], "system_port": 9090},
            {"role": "agg", "name": "agg-0", "args": ["--model", "/models/it's here"], "system_port": 9091},
        ]}, {"name": "b", "address": "10.0.0.12", "ssh": {"port": 2222}, "roles": [{"role": "prefill"}]}],
    }
    data.update(over)
    return parse_inventory(data, "inv.toml")


def test_example_inventory_parses() -> None:
    inv = load_inventory(EXAMPLE)
    assert inv.hosts and all(h.roles for h in inv.hosts)
    assert inv.cluster.discovery == "etcd"


def test_host_ssh_inherits_and_overrides() -> None:
    inv = _inv()
    a, b = inv.hosts
    assert a.ssh.user == b.ssh.user == "dynamo" and a.ssh.port == 22 and b.ssh.port == 2222
    assert a.ssh.key.endswith("/.ssh/id") and not a.ssh.key.startswith("~")
    assert [r.unit for r in a.roles] == ["dynamod-frontend", "dynamod-agg-0"]


def test_select_by_host_and_role() -> None:
    inv = _inv()
    assert [(h.name, [r.name for r in rs]) for h, rs in inv.select(role="agg")] == [("a", ["agg-0"])]
    assert [h.name for h, _ in inv.select(host="10.0.0.12")] == ["b"]
    with pytest.raises(ConfigError, match="nothing matches role 'router'"):
        inv.select(role="router")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["hosts"][0]["roles"][0].update(role="gpu"), "hosts[0].roles[0].role must be one of"),
        (lambda d: d["hosts"][0]["roles"][1].update(name="frontend"), "two roles named 'frontend'"),
        (lambda d: d["hosts"][0].update(adress="x"), "unknown field(s) adress"),
        (lambda d: d["cluster"].update(discovery="consul"), "cluster.discovery must be etcd or file"),
        (lambda d: d["hosts"][1]["ssh"].update(port="22"), "hosts[1].ssh.port must be a int"),
        (lambda d: d.update(hosts=[]), "no [[hosts]] defined"),
    ],
)
def test_inventory_errors_name_the_field(mutate, message: str) -> None:
    data = {
        "cluster": {"discovery": "etcd"},
        "hosts": [{"name": "a", "address": "10.0.0.11", "roles": [{"role": "frontend"}, {"role": "agg", "name": "agg-0"}]},
                  {"name": "b", "address": "10.0.0.12", "ssh": {"port": 22}, "roles": []}],
    }
    mutate(data)
    with pytest.raises(ConfigError) as err:
        parse_inventory(data, "inv.toml")
    assert message in str(err.value) and str(err.value).startswith("inv.toml")


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_inventory(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_inventory(bad)


def test_role_command_line() -> None:
    inv = _inv()
    argv = cmds.dynamod_argv(inv.cluster, inv.hosts[0].roles[1])
    assert argv[:3] == ["/opt/venv/bin/dynamod", "--role", "agg"]
    joined = " ".join(argv)
    assert "--namespace prod" in joined and "--etcd-endpoints http://10.0.0.1:2379" in joined
    assert "--system-port 9091" in joined and argv[-2:] == ["--model", "/models/it's here"]


@pytest.mark.parametrize("mode", [cmds.MODE_SYSTEM, cmds.MODE_USER, cmds.MODE_PROCESS])
def test_commands_are_valid_shell(mode: str) -> None:
    """Every generated command parses as POSIX sh (quoting of odd arguments included)."""
    inv = _inv()
    role = inv.hosts[0].roles[1]
    for script in (
        cmds.start_command(inv.cluster, role, mode),
        cmds.stop_command(inv.cluster, role, mode),
        cmds.status_command(inv.cluster, role, mode),
        cmds.logs_command(inv.cluster, role, mode, 50),
        cmds.mode_command(inv.cluster, role),
        cmds.health_command(inv.cluster, role),
    ):
        subprocess.run(["sh", "-n", "-c", script], check=True)


def test_systemd_start_is_a_transient_unit_restarted_on_failure() -> None:
    inv = _inv()
    role = inv.hosts[0].roles[1]
    cmd = cmds.start_command(inv.cluster, role, cmds.MODE_SYSTEM)
    assert "systemd-run" in cmd and "--unit=dynamod-agg-0" in cmd and "Restart=on-failure" in cmd
    assert "systemd-run --user" in cmds.start_command(inv.cluster, role, cmds.MODE_USER)
    assert "journalctl -u dynamod-agg-0" in cmds.logs_command(inv.cluster, role, cmds.MODE_SYSTEM, 10)


def test_process_supervisor_restarts_and_stops(tmp_path: Path) -> None:
    """The process-mode supervisor, run for real with a stand-in command: it keeps the role alive
    after a crash, and stop ends the whole process group."""
    inv = parse_inventory({
        "cluster": {"discovery": "file", "dynamod": "dynamod-stand-in", "workdir": str(tmp_path)},
        "hosts": [{"address": "127.0.0.1", "roles": [{"role": "up", "name": "svc", "args": []}]}],
    })
    role = inv.hosts[0].roles[0]
    # "dynamod-stand-in up" is not a real program; swap in one that runs until killed.
    script = cmds.start_command(inv.cluster, role, cmds.MODE_PROCESS).replace(
        shlex.join(["dynamod-stand-in", "up"]), "sleep 300"
    )
    assert "sleep 300" in script
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.startswith("started ")
    pgid = int((tmp_path / "run" / "svc.pid").read_text())
    from tests.fixtures.servers import wait_until

    child = wait_until(lambda: (tmp_path / "run" / "svc.child").read_text().strip(), 10, what="child pid")
    status = subprocess.run(["sh", "-c", cmds.status_command(inv.cluster, role, cmds.MODE_PROCESS)], capture_output=True, text=True).stdout
    assert status.split()[0] == "running"
    again = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    assert again.startswith("already running")
    subprocess.run(["kill", "-KILL", child], check=True)  # a crash: the supervisor starts it again
    wait_until(lambda: (tmp_path / "run" / "svc.child").read_text().strip() not in ("", child), 15, what="restart")
    stop = subprocess.run(["sh", "-c", cmds.stop_command(inv.cluster, role, cmds.MODE_PROCESS)], capture_output=True, text=True).stdout
    assert stop.strip() == "stopped"
    assert subprocess.run(["kill", "-0", "--", f"-{pgid}"], capture_output=True).returncode != 0
    assert "restarting" in (tmp_path / "logs" / "svc.log").read_text()
