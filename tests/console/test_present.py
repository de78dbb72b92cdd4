"""Formatting shared by the TUI and dynamoctl, and the console's connection settings."""

from __future__ import annotations

import argparse

import pytest

from dynamod.console.actions.control import resolve_instance_id
from dynamod.console.present import fmt_age, fmt_ms, fmt_pct, format_table, sparkline
from dynamod.console.settings import LOCAL_FRONTEND_URL, add_connection_args, settings_from_args
from dynamod.shared.errors import ConfigError, NotFoundError


def test_formatters() -> None:
    assert [fmt_age(x) for x in (None, 5, 125, 3 * 3600 + 60, 3 * 86400)] == ["-", "5s", "2m", "3h01", "3d"]
    assert fmt_pct(0.934) == "93%" and fmt_pct(None) == "-"
    assert [fmt_ms(x) for x in (0.0042, 0.180, 2.5)] == ["4.2ms", "180ms", "2.5s"]


def test_sparkline_scales_to_shared_max() -> None:
    assert sparkline([0, 4, 8], 3, 8.0) == "▁▅█"
    assert sparkline([1, 1], 4, 8.0) == "  ▂▂"  # right-aligned, newest at the right
    assert sparkline([], 3) == "   "
    assert sparkline([0, 0], 2) == "▁▁"


def test_format_table_aligns() -> None:
    assert format_table(("A", "BB"), [("xyz", "1")]) == "A    BB\nxyz  1"


def test_resolve_instance_id_by_prefix() -> None:
    known = [0x694D8C1E2F3A0B11, 0x694D8C1E2F3A0B22, 0x1234]
    assert resolve_instance_id("694d8c1e2f3a0b11", known) == known[0]
    assert resolve_instance_id("0x1234", known) == 0x1234
    assert resolve_instance_id("12", known) == 0x1234
    with pytest.raises(NotFoundError, match="ambiguous"):
        resolve_instance_id("694d", known)
    with pytest.raises(NotFoundError, match="no instance ffff"):
        resolve_instance_id("ffff", known)
    with pytest.raises(NotFoundError, match="not an instance id"):
        resolve_instance_id("worker-1", known)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_connection_args(p)
    return p.parse_args(argv)


def test_defaults_find_a_local_dynamod_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_FILE_KV", raising=False)
    s = settings_from_args(_parse([]))
    assert s.discovery == "file" and s.resolved_event_plane == "zmq" and s.namespace is None
    assert s.frontend_urls == [LOCAL_FRONTEND_URL]
    from dynamod.shared.discovery.factory import default_file_kv_dir

    assert s.discovery_target() == default_file_kv_dir()


def test_etcd_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_SERVER", "nats://10.1.1.1:4222")
    s = settings_from_args(_parse(["--discovery", "etcd", "--etcd", "http://127.0.0.1:1,http://127.0.0.1:2", "--namespace", "prod"]))
    assert s.resolved_event_plane == "nats" and s.nats_server == "nats://10.1.1.1:4222"
    assert len(s.etcd_endpoints) == 2 and s.namespace == "prod" and s.frontend_urls == []
    rs = s.runtime_settings()
    assert rs.discovery_backend == "etcd" and rs.event_plane == "nats" and rs.system_port is None


def test_bad_namespace_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        settings_from_args(_parse(["--namespace", "a/b"]))
