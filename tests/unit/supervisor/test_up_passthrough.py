"""``dynamod up``'s reading of its pass-through flags, its probes and its directory lock (issue 24
items 1-4, 7), without starting a cluster; ``tests/integration/up/test_up_traps.py`` runs them for real."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest

from dynamod.daemon.supervisor.cluster_lock import ClusterLock, lock_path
from dynamod.daemon.supervisor.passthrough import check_owned, flag_value, join_passthrough_values
from dynamod.daemon.supervisor.probe import frontend_target
from dynamod.daemon.supervisor.up import WorkerFactory, add_args, parse_args, runtime_flags
from dynamod.shared.cli_parser import ArgumentParser
from dynamod.shared.errors import ConfigError
from tests.fixtures.tls import make_cluster_certs


def _up_args(*argv: str) -> argparse.Namespace:
    parser = ArgumentParser(prog="dynamod up")
    add_args(parser)
    return parse_args(parser, list(argv))


def test_the_word_after_a_pass_through_flag_is_its_value() -> None:
    args = _up_args("--frontend-args", "--router-conditional-disagg", "--workers", "3", "--worker-args", "-x")
    assert (args.frontend_args, args.workers, args.worker_args) == ("--router-conditional-disagg", 3, "-x")
    assert join_passthrough_values(["--planner-args"]) == ["--planner-args"]  # no value: argparse says so


@pytest.mark.parametrize(
    ("flag", "value", "owned"),
    [
        ("--worker-args", "--max-num-seqs 8 --system-port=0", "--system-port"),
        ("--decode-args", "--worker-name w", "--worker-name"),
        ("--frontend-args", "--router-mode kv", "--router-mode"),
        ("--planner-args", "--connector virtual", "--connector"),
    ],
)
def test_a_flag_up_sets_is_refused_in_pass_through_args(flag: str, value: str, owned: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{flag}: {owned} is set by `dynamod up`"):
        check_owned({flag: value})


def test_other_flags_and_an_open_quote() -> None:
    check_owned({"--worker-args": "--max-num-seqs 8 --system-host 0.0.0.0", "--frontend-args": "--rate-limit 5"})
    with pytest.raises(ConfigError, match="--worker-args: No closing quotation"):
        check_owned({"--worker-args": "--served-model-name 'x"})
    assert flag_value(["--a", "1", "--a=2"], "--a") == "2" and flag_value(["--ab", "1"], "--a") is None


@pytest.mark.parametrize(("host", "probed"), [("0.0.0.0", "127.0.0.1"), ("127.0.0.2", "127.0.0.2")])
def test_a_worker_is_probed_where_its_status_server_binds(tmp_path: Path, host: str, probed: str) -> None:
    args = _up_args("--worker-args", f"--system-host {host}")
    spec = WorkerFactory(args, *runtime_flags(str(tmp_path), "dynamo")).spec("agg", 0)
    assert spec.live_url is not None and spec.live_url.startswith(f"http://{probed}:")
    assert spec.pool == "agg" and spec.hang_after_s == args.hang_timeout


def test_the_frontend_probe_speaks_https_and_presents_a_key(tmp_path: Path) -> None:
    certs = make_cluster_certs(tmp_path / "certs")
    keys = tmp_path / "keys"
    keys.write_text("# ops\n" + "k" * 20 + "\n")
    words = ["--http-tls-cert-file", certs.node_cert, f"--api-key-file={keys}"]
    target = frontend_target("0.0.0.0", 8443, words, env={})
    assert target.base_url == "https://127.0.0.1:8443"
    assert isinstance(target.ssl_context, ssl.SSLContext) and target.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert target.api_key() == "k" * 20
    from_env = frontend_target("127.0.0.1", 8000, [], env={"DYN_API_KEY": " first-key-0123456789, second", "DYN_API_KEY_FILE": str(keys)})
    assert from_env.base_url == "http://127.0.0.1:8000" and from_env.ssl_context is None
    assert from_env.api_key() == "first-key-0123456789"
    missing = frontend_target("127.0.0.1", 8000, [f"--http-tls-cert-file={tmp_path / 'nope.pem'}"], env={"DYN_API_KEY": "x" * 20})
    assert missing.base_url.startswith("https://") and missing.api_key() is None  # no key to an unverified port


def test_one_up_per_directory(tmp_path: Path) -> None:
    first = ClusterLock(tmp_path / "discovery", "--file-kv")
    first.acquire({"url": "127.0.0.1:8000"})
    try:
        with pytest.raises(ConfigError, match=r"another `dynamod up` \(pid \d+, frontend 127.0.0.1:8000\) .*--file-kv DIR"):
            ClusterLock(tmp_path / "discovery", "--file-kv").acquire({"url": "127.0.0.1:8002"})
        assert lock_path(tmp_path / "discovery") == tmp_path / "discovery.up.lock"
    finally:
        first.release()
    again = ClusterLock(tmp_path / "discovery", "--file-kv")
    again.acquire({})  # released: the next `up` takes it
    again.release()
