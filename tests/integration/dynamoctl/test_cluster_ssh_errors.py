"""``dynamoctl cluster``'s SSH errors are whole (issue 24 item 17): the table printed
"connection refused (is sshd running on that port?" cut at 80 columns. No sshd is needed: the
inventory's SSH port is a free one, so the connection is refused."""

from __future__ import annotations

import getpass
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest

from dynamod.shared.cluster.roles import last_lines
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.timeout(60)


def test_a_refused_connection_is_reported_whole_in_the_table(tmp_path: Path) -> None:
    key = tmp_path / "key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(key))
    port = free_port()
    inv = tmp_path / "inv.toml"
    inv.write_text(f"""
[cluster]
namespace = "dynamo"
discovery = "file"
file_kv = "{tmp_path / 'kv'}"
event_plane = "zmq"
workdir = "{tmp_path / 'work'}"

[ssh]
user = "{getpass.getuser()}"
key = "{key}"
port = {port}
known_hosts = "none"
connect_timeout_s = 5

[[hosts]]
name = "a-host-with-a-rather-long-name"
address = "127.0.0.1"

  [[hosts.roles]]
  role = "agg"
  name = "agg-0"
  args = ["--engine", "mocker"]
  system_port = {free_port()}
""")
    res = subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "cluster", "status", "--inventory", str(inv)],
                         capture_output=True, text=True, timeout=50)
    assert res.returncode == 1, res.stderr
    whole = "connection refused (is sshd running on that port?)"
    row = [line for line in res.stdout.splitlines() if "agg-0" in line]
    assert len(row) == 1 and row[0].rstrip().endswith(whole), res.stdout
    assert res.stderr.strip().endswith(whole)


def test_remote_error_output_keeps_its_last_whole_lines() -> None:
    """A failed start's stderr (a traceback) is reported by its last lines, never cut mid-word."""
    trace = "Traceback (most recent call last):\n" + "".join(f'  File "x{i}.py", line {i}\n' for i in range(60))
    text = trace + "ModuleNotFoundError: No module named 'dynamod'\n"
    brief = last_lines(text, 200)
    assert brief.startswith("... | ") and brief.endswith("ModuleNotFoundError: No module named 'dynamod'")
    assert len(brief) <= 206 and all(part.startswith(("File", "...", "ModuleNotFoundError")) for part in brief.split(" | "))
    assert last_lines("one line\n") == "one line"
