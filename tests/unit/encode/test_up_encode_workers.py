"""``dynamod up --encode-workers N``: N encode workers (``--role encode``) beside the agg or the
prefill/decode pools, with the cluster's model, the mocker's speedup and ``--encode-args``, and
without the engine flags they have no use for."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.supervisor.up import add_args, build_specs, resolve_scaling
from dynamod.shared.errors import ConfigError


def _specs(*argv: str):  # noqa: ANN202
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(list(argv))
    resolve_scaling(args)
    return build_specs(args, "/tmp/kv", "ns")


def test_encode_workers_are_started_with_their_flags() -> None:
    specs = _specs("--model", "tiny-vl", "--workers", "1", "--encode-workers", "2", "--speedup-ratio", "4",
                   "--block-size", "16", "--encode-args", "--encode-ms-per-image-token 0.2")
    encoders = [s for s in specs if s.argv[s.argv.index("--role") + 1] == "encode"]
    assert [s.name for s in encoders] == ["encode-0", "encode-1"]
    argv = encoders[0].argv
    assert argv[argv.index("--model") + 1] == "tiny-vl" and float(argv[argv.index("--speedup-ratio") + 1]) == 4
    assert argv[-2:] == ["--encode-ms-per-image-token", "0.2"] and "--block-size" not in argv
    assert encoders[0].argv[argv.index("--system-port") + 1] != encoders[1].argv[argv.index("--system-port") + 1]
    assert not [s for s in _specs("--model", "tiny-vl") if s.name.startswith("encode-")]


def test_negative_encode_workers_refused() -> None:
    with pytest.raises(ConfigError, match="--encode-workers"):
        _specs("--encode-workers", "-1")
