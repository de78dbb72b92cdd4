"""``dynamoctl cluster up`` with the cluster's secrets: the inventory names files on the operator's
machine, they reach each host over the SSH channel's stdin (mode 0600 under the workdir), and the
role gets their paths in its environment. The token itself is on no command line of the host, and
the running role uses it (its /health shows instance details only to a caller with the token)."""

from __future__ import annotations

import json
import os
import stat
import urllib.request
from pathlib import Path

from dynamod.shared.security.certs import write_token
from tests.fixtures.servers import free_port, wait_until
from tests.integration.dynamoctl.test_cluster_ssh import PrivateSshd, ctl, pytestmark, sshd, write_inventory  # noqa: F401

__all__ = ["pytestmark", "sshd"]


def _health(port: int, token: str | None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/health")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=3) as resp:
        return json.loads(resp.read())


def _cmdlines() -> list[bytes]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:
                pass
    return out


def test_cluster_up_carries_the_token_file_to_the_role(sshd: PrivateSshd, tmp_path: Path) -> None:
    token_file = write_token(tmp_path / "secrets-here")
    token = token_file.read_text().strip()
    file_kv, workdir, system_port = str(tmp_path / "file-kv"), tmp_path / "work", free_port()
    inv = write_inventory(tmp_path / "inv.toml", sshd, file_kv, workdir, system_port=system_port)
    text = inv.read_text()
    inv.write_text(text.replace("\n[ssh]", f'secret_files = {{ DYN_CLUSTER_TOKEN_FILE = "{token_file}" }}\n\n[ssh]', 1))

    up = ctl("cluster", "up", "--inventory", str(inv), "--json", "--wait", "90")
    assert up.returncode == 0, (up.stdout, up.stderr)
    try:
        assert json.loads(up.stdout)[0]["health"] == "ok"
        remote = workdir / "secrets" / "DYN_CLUSTER_TOKEN_FILE"
        assert remote.read_text().strip() == token
        assert stat.S_IMODE(remote.stat().st_mode) == 0o600
        # The worker process (pid from discovery) has the path in its environment.
        wait_until(lambda: json.loads(ctl("--file-kv", file_kv, "status", "--json").stdout), 30, what="workers")
        [pid] = {w["pid"] for w in json.loads(ctl("--file-kv", file_kv, "status", "--json").stdout)}
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"DYN_CLUSTER_TOKEN_FILE={remote}".encode() in environ
        # ...and uses the token: details for members only.
        assert "endpoints" in _health(system_port, token)
        assert "endpoints" not in _health(system_port, None)
        # No command line on the host carries it (the role's, its supervising shell's, sshd's).
        assert not [c for c in _cmdlines() if token.encode() in c]
    finally:
        down = ctl("cluster", "down", "--inventory", str(inv), "--json")
        assert down.returncode == 0, down.stderr


def test_a_secret_value_in_the_inventory_env_is_refused(sshd: PrivateSshd, tmp_path: Path) -> None:
    inv = write_inventory(tmp_path / "inv.toml", sshd, tmp_path / "kv", tmp_path / "work", system_port=free_port())
    inv.write_text(inv.read_text().replace("env = { ", 'env = { DYN_CLUSTER_TOKEN = "x" * 20, ', 1)
                   .replace('"x" * 20', '"0123456789abcdef0123"'))
    res = ctl("cluster", "up", "--inventory", str(inv), "--json")
    assert res.returncode != 0
    assert "DYN_CLUSTER_TOKEN" in res.stderr and "visible in ps" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
