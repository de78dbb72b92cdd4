"""Both KV index implementations, for tests that must hold for each.

The compiled core is imported directly (whatever ``DYN_KV_INDEX_IMPL`` says) so both run in one
session; its tests are skipped only when it was not built, and the skip says why.
"""

from __future__ import annotations

import pytest

from dynamod.daemon.router.core.native import SCHED_CORE_MODULE
from dynamod.shared.kv.index_common import KvIndexerBase
from dynamod.shared.kv.index_native import NativeKvIndexer
from dynamod.shared.kv.index_python import PythonKvIndexer
from dynamod.shared.kv.native import import_core

NATIVE_CORE, NATIVE_ERROR = import_core()
needs_native = pytest.mark.skipif(NATIVE_CORE is None, reason=f"compiled KV core not built: {NATIVE_ERROR}")
SCHED_CORE, SCHED_ERROR = import_core(SCHED_CORE_MODULE)
needs_sched_native = pytest.mark.skipif(SCHED_CORE is None, reason=f"compiled scheduler core not built: {SCHED_ERROR}")

IMPLS = [pytest.param("python", id="python"), pytest.param("native", id="native", marks=needs_native)]


def make_index(impl: str) -> KvIndexerBase:
    if impl == "python":
        return PythonKvIndexer()
    if impl == "native":
        return NativeKvIndexer(NATIVE_CORE)
    raise ValueError(impl)
