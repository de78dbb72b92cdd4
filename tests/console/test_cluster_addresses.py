"""``dynamoctl cluster up`` puts each host's address on its roles' command lines, so every listener
binds and advertises an address the other hosts can dial (issue 13: nothing stays on loopback)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dynamod.console.ctl.cluster import commands as cmds
from dynamod.console.ctl.cluster.inventory import load_inventory, parse_inventory
from dynamod.shared.config import add_runtime_args, settings_from_args
from dynamod.shared.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "inventory" / "cluster.example.toml"


def _flag(argv: list[str], name: str) -> str | None:
    """The value argparse would keep for ``name`` (the last one)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else None


def test_example_inventory_binds_every_role_to_its_host() -> None:
    inv = load_inventory(EXAMPLE)
    for host in inv.hosts:
        for role in host.roles:
            argv = cmds.dynamod_argv(inv.cluster, role, host)
            assert _flag(argv, "--host") == host.listen_address != "127.0.0.1", (host.name, role.name)
            if role.system_port is not None:
                assert _flag(argv, "--system-host") == host.listen_address
            if role.role == "frontend":
                assert _flag(argv, "--http-host") == host.listen_address
            assert "127.0.0.1" not in argv
    gpu_b = next(h for h in inv.hosts if h.name == "gpu-b")
    assert gpu_b.address != gpu_b.listen_address == "10.0.0.12"  # SSH one way, the cluster another


def test_host_address_reaches_the_runtime_settings() -> None:
    """The flags cluster up writes are the ones the daemons read, and a role's own args win."""
    inv = parse_inventory({
        "cluster": {"discovery": "etcd", "etcd_endpoints": ["http://10.0.0.1:2379"]},
        "hosts": [{"name": "w", "address": "10.0.0.21", "roles": [
            {"role": "agg", "system_port": 9091},
            {"role": "decode", "args": ["--advertise-host", "198.51.100.7", "--request-plane-port", "7001"]},
        ]}],
    })
    host = inv.hosts[0]
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    agg = settings_from_args(parser.parse_known_args(cmds.dynamod_argv(inv.cluster, host.roles[0], host)[1:])[0])
    assert (agg.host, agg.system_host, agg.system_port) == ("10.0.0.21", "10.0.0.21", 9091)
    assert agg.advertised(agg.host) == "10.0.0.21"
    decode = settings_from_args(parser.parse_known_args(cmds.dynamod_argv(inv.cluster, host.roles[1], host)[1:])[0])
    assert decode.host == "10.0.0.21" and decode.advertised(decode.host) == "198.51.100.7"
    assert decode.request_plane_port == 7001


def test_health_check_dials_where_the_status_server_listens() -> None:
    inv = load_inventory(EXAMPLE)
    host = inv.hosts[0]
    role = next(r for r in host.roles if r.system_port is not None)
    assert f"http://{host.listen_address}:{role.system_port}/health" in cmds.health_command(inv.cluster, role, host)
    assert f"http://127.0.0.1:{role.system_port}/health" in cmds.health_command(inv.cluster, role)  # single host


def test_start_command_carries_the_host_address() -> None:
    inv = load_inventory(EXAMPLE)
    host = inv.hosts[1]
    script = cmds.start_command(inv.cluster, host.roles[0], cmds.MODE_PROCESS, host)
    assert f"--host {host.listen_address}" in script


@pytest.mark.parametrize("field", ["address", "cluster_address"])
def test_a_wildcard_host_address_is_refused(field: str) -> None:
    host = {"name": "a", "address": "10.0.0.11", "roles": [{"role": "agg"}]}
    host[field] = "0.0.0.0"
    with pytest.raises(ConfigError, match=f"hosts\\[0\\].{field} must be an address the other hosts can dial"):
        parse_inventory({"cluster": {"discovery": "etcd"}, "hosts": [host]}, "inv.toml")
