"""The router's compiled scheduler loops (``_schedcore``, _native/schedcore.c), or None.

Chosen like the KV index's core (shared/kv/native.py: ``DYN_KV_INDEX_IMPL``, ``DYN_REQUIRE_NATIVE``),
so one switch runs the whole router compiled or in pure Python.
"""

from __future__ import annotations

from dynamod.shared.kv.native import select_core

SCHED_CORE_MODULE = "dynamod.daemon.router.core._schedcore"

core, unavailable_reason = select_core(SCHED_CORE_MODULE)
"""The compiled module in use, or None (then ``unavailable_reason`` says why)."""
