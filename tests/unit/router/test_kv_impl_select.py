"""Choosing the KV index implementation: ``DYN_KV_INDEX_IMPL=python`` forces the pure-Python index
and hashing (checked in a fresh interpreter, since the choice is made at import)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.router.kv_impls import needs_native

PROBE = (
    "from dynamod.shared.kv import hashing, indexer; "
    "print(indexer.kv_index_implementation(), hashing.compute_block_hashes is hashing.compute_block_hashes_py)"
)


def _probe(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DYN_KV_INDEX_IMPL"}
    if value is not None:
        env["DYN_KV_INDEX_IMPL"] = value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_python_is_forced_by_the_environment():
    assert _probe("python") == "python True"


@needs_native
@pytest.mark.parametrize("value", [None, "auto", "native", "bogus"])
def test_the_compiled_core_is_used_when_built(value):
    """Unset, ``auto`` and ``native`` use the compiled core; an unknown value falls back to auto."""
    assert _probe(value) == "native False"
