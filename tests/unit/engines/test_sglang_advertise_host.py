"""The address an SGLang prefill engine gives decode workers for its bootstrap server is the
runtime's advertised address (``--advertise-host``, wildcards, ``DYN_HOST``), not ``args.host``.
SGLang itself cannot be installed here: this checks the address the engine would be given and what
``bootstrap_endpoint`` makes of it."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from dynamod.daemon.engines.sglang import adapter
from dynamod.daemon.engines.sglang.disagg import bootstrap_endpoint
from dynamod.daemon.worker.main import add_args, parse_args
from dynamod.shared.transport.address import advertised_host


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_args(parser)
    return parse_args(parser, ["--role", "prefill", "--engine", "sglang", "--model", "m", *argv])


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--host", "10.0.0.5"], {}, "10.0.0.5"),
        (["--host", "0.0.0.0", "--advertise-host", "node1.example"], {}, "node1.example"),
        (["--host", "10.0.0.5", "--advertise-host", "203.0.113.7"], {}, "203.0.113.7"),
        ([], {"DYN_HOST": "10.1.1.1"}, "10.1.1.1"),  # args.host is None: the old code said 127.0.0.1
        (["--host", "10.0.0.5"], {"DYN_ADVERTISE_HOST": "node2.example"}, "node2.example"),
        ([], {}, "127.0.0.1"),
    ],
)
def test_bootstrap_host_is_the_runtimes_advertised_address(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], expected: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = _args(*argv)
    assert adapter.advertised_host(args) == expected
    server_args = SimpleNamespace(dist_init_addr=None, disaggregation_bootstrap_port=8998)
    assert bootstrap_endpoint(server_args, adapter.advertised_host(args)) == (expected, 8998)


def test_a_wildcard_without_advertise_host_names_this_node() -> None:
    assert adapter.advertised_host(_args("--host", "0.0.0.0")) == advertised_host("0.0.0.0")
    assert adapter.advertised_host(_args("--host", "0.0.0.0")) not in ("0.0.0.0", "")


def test_create_hands_the_engine_that_address(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    class Recorder:
        def __init__(self, *a: object, **kw: object) -> None:
            seen.update(kw)

    monkeypatch.setattr(adapter, "SglangEngine", Recorder)
    adapter.create(_args("--host", "0.0.0.0", "--advertise-host", "node1.example"), model=None, worker_id=1)  # type: ignore[arg-type]
    assert seen["advertise_host"] == "node1.example"
