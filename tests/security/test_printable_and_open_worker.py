"""Network strings printed safely (item 7) and an open worker warned about (item 6)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from dynamod.daemon.worker.main import warn_if_open
from dynamod.shared.security.printable import printable
from tests.fixtures.daemons import DaemonProcess, file_cluster_env

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("raw, shown", [
    ("sql-lora", "sql-lora"),
    ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),
    ("\x1b[2J\rready", "\\x1b[2J\\x0dready"),
    ("abc\u202edcba", "abc\\u202edcba"),
    ("a\u2028b\x85c", "a\\u2028b\\x85c"),
    ("naïve 中文 ok", "naïve 中文 ok"),
])
def test_printable_escapes_what_a_terminal_would_obey(raw: str, shown: str) -> None:
    assert printable(raw) == shown


def test_printable_cuts_long_values() -> None:
    assert printable("x" * 1000, max_chars=10) == "x" * 10 + "…"
    assert printable("\x1b" * 100, max_chars=8) == "\\x1b\\x1b…"


def test_warn_if_open(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert warn_if_open("0.0.0.0", secured=False)
        assert not warn_if_open("0.0.0.0", secured=True)
        assert not warn_if_open("127.0.0.1", secured=False)
    assert sum("security=none" in r.getMessage() for r in caplog.records) == 1


def test_a_worker_on_every_interface_without_a_token_warns(tmp_path: Path) -> None:
    env = file_cluster_env(tmp_path / "kv")
    worker = DaemonProcess(["--role", "agg", "--engine", "mocker", "--model", "tiny", "--host", "0.0.0.0"],
                           env=env, log_dir=str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "node daemon up" not in worker.log():
            assert worker.alive(), worker.log()
            time.sleep(0.05)
        lines = [ln for ln in worker.log().splitlines() if "open beyond loopback" in ln]
        assert len(lines) == 1 and "WARN" in lines[0] and "security=none" in lines[0], worker.log()[-2000:]
    finally:
        worker.kill()
