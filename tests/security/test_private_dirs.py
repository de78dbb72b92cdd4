"""Per-user private state directories (issue 25, item 8), with real worker processes.

A discovery directory or a disk-tier directory another user created first is refused at start-up
with one line; the default per-user directory is created (or tightened to) 0700; a symlink is
refused. Simulating "another user" needs root (``chown``); without it those cases are skipped.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dynamod.shared.errors import ConfigError
from dynamod.shared.security.private_dir import ensure_private_dir, private_root_for
from tests.fixtures.daemons import ROOT

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534


def _give_away(path: Path) -> None:
    try:
        os.chown(path, NOBODY, NOBODY)
    except PermissionError:
        pytest.skip("needs root to create a directory owned by another user")


def _worker(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """A worker that must refuse to start: it exits by itself, well within the timeout."""
    return subprocess.run(
        [sys.executable, "-m", "dynamod.daemon.cli", "--role", "agg", "--engine", "mocker", "--model", "tiny",
         "--discovery-backend", "file", "--event-plane", "zmq", *extra],
        env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=45,
    )


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env.update(XDG_RUNTIME_DIR=str(tmp_path / "run"), **extra)
    (tmp_path / "run").mkdir(exist_ok=True)
    return env


def test_a_discovery_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "run" / f"dynamod-{os.getuid()}"
    planted.mkdir(parents=True)
    _give_away(planted)
    res = _worker(_env(tmp_path))
    assert res.returncode != 0
    assert f"belongs to uid {NOBODY}" in res.stderr + res.stdout, res.stderr[-2000:]


def test_a_disk_tier_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    _give_away(disk)
    res = _worker(_env(tmp_path), "--num-disk-blocks", "8", "--num-host-blocks", "8", "--disk-cache-dir", str(disk))
    assert res.returncode != 0
    assert f"--disk-cache-dir: {disk} belongs to uid {NOBODY}" in res.stderr + res.stdout, res.stderr[-2000:]


def test_defaults_are_per_user_and_0700(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    from dynamod.daemon.engines.mocker import config
    from dynamod.shared.discovery.factory import default_file_kv_dir

    monkeypatch.delenv("DYN_FILE_KV", raising=False)
    kv = Path(default_file_kv_dir())
    assert kv == tmp_path / f"dynamod-{os.getuid()}" / "discovery"
    (tmp_path / f"dynamod-{os.getuid()}").mkdir(mode=0o755)
    os.chmod(tmp_path / f"dynamod-{os.getuid()}", 0o755)  # as an older version left it
    ensure_private_dir(kv, what="t", owned_from=private_root_for(kv))
    for d in (kv, kv.parent):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert "dynamod-kv-disk" not in config.DEFAULT_DISK_CACHE_DIR and "kv-disk" in config.DEFAULT_DISK_CACHE_DIR
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ConfigError, match="not a plain directory"):
        ensure_private_dir(link, what="t")
