"""``dynamod up`` pool flags without processes: how the flags combine, and when /health counts as
the whole cluster being ready (the banner waits for it)."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.supervisor.up import Pools, add_args, build_specs, ready_models, resolve_pools
from dynamod.shared.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def test_flags_combine() -> None:
    assert resolve_pools(_args()) == Pools(agg=2)
    assert resolve_pools(_args("--workers", "3")) == Pools(agg=3)
    assert resolve_pools(_args("--prefill-workers", "1", "--decode-workers", "2")) == Pools(prefill=1, decode=2)
    assert resolve_pools(_args("--decode-workers", "2")) == Pools(decode=2)  # local prefill only
    with pytest.raises(ConfigError, match="cannot be combined"):
        resolve_pools(_args("--workers", "1", "--prefill-workers", "1", "--decode-workers", "1"))
    with pytest.raises(ConfigError, match="needs --decode-workers"):
        resolve_pools(_args("--prefill-workers", "1", "--decode-workers", "0"))


def test_each_worker_has_its_role_and_own_status_port() -> None:
    specs = build_specs(_args("--prefill-workers", "2", "--decode-workers", "2", "--decode-args", "--x 1"), "/tmp/kv", "ns")
    workers = specs[1:]
    assert [s.name for s in workers] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    roles = [s.argv[s.argv.index("--role") + 1] for s in workers]
    assert roles == ["prefill", "prefill", "decode", "decode"]
    ports = [s.argv[s.argv.index("--system-port") + 1] for s in workers]
    assert len(set(ports)) == 4
    assert all(s.live_url == f"http://127.0.0.1:{port}/live" for s, port in zip(workers, ports, strict=True))
    assert [("--x" in s.argv) for s in workers] == [False, False, True, True]


def _health(ready: int, prefill_ready: int | None = None, lora_ready: int = 0) -> dict:
    tiny: dict = {"model": "tiny", "lora": None, "ready": ready}
    if prefill_ready is not None:
        tiny["prefill_ready"] = prefill_ready
    return {"models": [tiny, {"model": "ad", "lora": "ad", "ready": lora_ready}]}


def test_ready_waits_for_both_pools() -> None:
    pools = Pools(prefill=2, decode=1)
    assert ready_models(_health(1), pools) is None  # the frontend has not seen a prefill worker
    assert ready_models(_health(1, 1), pools) is None
    assert ready_models(_health(0, 2, lora_ready=5), pools) is None  # adapters are not decode workers
    assert ready_models(_health(1, 2), pools) == ["tiny"]
    assert ready_models(_health(2), Pools(agg=2)) == ["tiny"]
    assert ready_models(_health(1), Pools(decode=1)) == ["tiny"]
