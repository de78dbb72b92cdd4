"""dynamoctl cluster up/status/logs/down over real SSH: a private sshd on 127.0.0.1 (started by the
test, key auth only) and a mocker worker role started, health-checked and stopped through it."""

from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncssh
import pytest

from tests.console.live import MockerCluster
from tests.fixtures.servers import free_port, wait_until

SSHD = "/usr/sbin/sshd"
DYNAMOD = Path(sys.executable).parent / "dynamod"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.path.exists(SSHD), reason="needs openssh-server (/usr/sbin/sshd); scripts/test.sh installs it"),
    pytest.mark.skipif(not DYNAMOD.exists(), reason=f"needs the dynamod entry point at {DYNAMOD} (pip install -e .)"),
]


class PrivateSshd:
    """sshd on a free loopback port with its own host key, authorized keys and pid file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.client_key = root / "client_ed25519"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateSshd:
        self.root.mkdir(parents=True, exist_ok=True)
        host_key = self.root / "host_ed25519"
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(host_key))
        host_key.chmod(0o600)
        client = asyncssh.generate_private_key("ssh-ed25519")
        client.write_private_key(str(self.client_key))
        self.client_key.chmod(0o600)
        auth = self.root / "authorized_keys"
        client.write_public_key(str(auth))
        config = self.root / "sshd_config"
        config.write_text(
            f"ListenAddress 127.0.0.1\nPort {self.port}\nHostKey {host_key}\nPidFile {self.root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {auth}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\nLogLevel ERROR\n"
        )
        os.makedirs("/run/sshd", exist_ok=True)
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.root / "sshd.log", "wb"))  # noqa: SIM115

        def listening() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()}")
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        wait_until(listening, 15, what="sshd")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateSshd]:
    server = PrivateSshd(tmp_path_factory.mktemp("sshd")).start()
    try:
        yield server
    finally:
        server.stop()


def role_toml(name: str, args: list[str], system_port: int, role: str = "agg") -> str:
    """One ``[[hosts.roles]]`` entry of the inventory's single host."""
    argv = ", ".join(f'"{a}"' for a in args)
    return f"""
  [[hosts.roles]]
  role = "{role}"
  name = "{name}"
  args = [{argv}]
  system_port = {system_port}
"""


def write_inventory(
    path: Path, sshd: PrivateSshd, file_kv: str | Path, workdir: Path, *, port: int | None = None,
    system_port: int | None = None, roles: str | None = None,
) -> Path:
    """An inventory of one host (this machine, through the private sshd) with ``roles`` (default:
    one agg role running two mocker workers on ``system_port``)."""
    if roles is None:
        assert system_port is not None
        args = ["--engine", "mocker", "--model", "tiny", "--speedup-ratio", "10", "--num-workers", "2", "--lease-ttl", "3"]
        roles = role_toml("agg-0", args, system_port)
    env = {"DYN_LOG": "info"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    path.write_text(f"""
[cluster]
namespace = "dynamo"
discovery = "file"
file_kv = "{file_kv}"
event_plane = "zmq"
dynamod = "{DYNAMOD}"
python = "{sys.executable}"
workdir = "{workdir}"
env = {{ {env_toml} }}

[ssh]
user = "{getpass.getuser()}"
key = "{sshd.client_key}"
port = {port or sshd.port}
known_hosts = "none"
connect_timeout_s = 5

[[hosts]]
name = "local"
address = "127.0.0.1"
{roles}""")
    return path


def ctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", *args], capture_output=True, text=True, timeout=timeout)


def test_cluster_up_status_logs_down(sshd: PrivateSshd, tmp_path: Path) -> None:
    file_kv = str(tmp_path / "file-kv")
    inv = write_inventory(tmp_path / "inv.toml", sshd, file_kv, tmp_path / "work", system_port=free_port())
    up = ctl("cluster", "up", "--inventory", str(inv), "--json", "--wait", "90")
    assert up.returncode == 0, (up.stdout, up.stderr)
    [row] = json.loads(up.stdout)
    assert row["state"] == "started" and row["health"] == "ok" and row["mode"] in ("process", "systemd", "systemd-user")
    try:
        # The role is a real dynamod worker process: it is in discovery, with its pid.
        status = ctl("cluster", "status", "--inventory", str(inv), "--json")
        assert status.returncode == 0, status.stderr
        [st] = json.loads(status.stdout)
        assert st["state"] == "running" and st["health"] == "ok" and st["pid"] > 0
        probe = MockerCluster(tmp_path)
        probe.file_kv = file_kv
        wait_until(lambda: len(probe.instance_ids()) == 2, 30, what="the role's two workers in discovery")
        workers = json.loads(ctl("--file-kv", file_kv, "status", "--json").stdout)
        assert {w["pid"] for w in workers} == {st["pid"]}
        # Up again is a no-op, not a second copy.
        again = ctl("cluster", "up", "--inventory", str(inv), "--json")
        assert again.returncode == 0 and json.loads(again.stdout)[0]["state"] == "already running"
        logs = ctl("cluster", "logs", "--inventory", str(inv), "-n", "200")
        assert logs.returncode == 0 and "==> local/agg-0 <==" in logs.stdout and "worker registered" in logs.stdout
    finally:
        down = ctl("cluster", "down", "--inventory", str(inv), "--json")
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout)[0]["state"] in ("stopped", "killed")
    # Stopped means gone: the process, and (it deregistered on SIGTERM) its workers in discovery.
    assert subprocess.run(["kill", "-0", str(st["pid"])], capture_output=True).returncode != 0
    wait_until(lambda: probe.instance_ids() == [], 15, what="the workers to leave discovery")
    after = ctl("cluster", "status", "--inventory", str(inv), "--json")
    assert after.returncode == 1 and json.loads(after.stdout)[0]["state"] == "stopped"


def test_unreachable_host_is_one_line_and_non_zero(sshd: PrivateSshd, tmp_path: Path) -> None:
    inv = write_inventory(tmp_path / "inv.toml", sshd, str(tmp_path / "kv"), tmp_path / "work", port=free_port(), system_port=free_port())
    res = ctl("cluster", "status", "--inventory", str(inv))
    assert res.returncode == 1
    errors = [x for x in res.stderr.splitlines() if x]
    assert len(errors) == 1 and errors[0].startswith("dynamoctl: error: local/agg-0") and "refused" in errors[0]


def test_bad_key_is_reported(sshd: PrivateSshd, tmp_path: Path) -> None:
    other = tmp_path / "other_key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(other))
    inv = write_inventory(tmp_path / "inv.toml", sshd, str(tmp_path / "kv"), tmp_path / "work", system_port=free_port())
    inv.write_text(inv.read_text().replace(str(sshd.client_key), str(other)))
    res = ctl("cluster", "status", "--inventory", str(inv))
    assert res.returncode == 1 and "permission denied" in res.stderr


def test_missing_inventory_is_one_line() -> None:
    res = ctl("cluster", "status", "--inventory", "/nonexistent/inv.toml")
    assert res.returncode == 1 and res.stderr.strip() == "dynamoctl: error: inventory /nonexistent/inv.toml not found"


def test_down_never_signals_a_reused_pid(sshd: PrivateSshd, tmp_path: Path) -> None:
    """A process-mode pid file left behind whose pid the kernel has handed to another process (here
    a ``sleep`` leading its own group): ``cluster down`` reports the role not running and the
    stranger lives on."""
    work = tmp_path / "work"
    inv = write_inventory(tmp_path / "inv.toml", sshd, str(tmp_path / "kv"), work, system_port=free_port())
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        (work / "run").mkdir(parents=True)
        (work / "run" / "agg-0.pid").write_text(f"{stranger.pid}\n")
        (work / "run" / "agg-0.started").write_text("1\n")  # the start time of the process we started
        (work / "run" / "agg-0.mode").write_text("process")
        down = ctl("cluster", "down", "--inventory", str(inv), "--json")
        assert down.returncode == 0, down.stderr
        assert json.loads(down.stdout)[0]["state"] == "not running"
        assert stranger.poll() is None, "cluster down signalled a process it did not start"
    finally:
        stranger.kill()
        stranger.wait(10)
