"""Finds the compiled KV core (``dynamod.shared.kv._kvcore``, shared/kv/_native/kvcore.c) and
decides whether to use it. ``select_core`` makes the same choice for any compiled twin (the router's
scheduler loops, daemon/router/core/native.py, use it too), so one switch governs them all.

``DYN_KV_INDEX_IMPL``: ``auto`` (default: the compiled core when it was built, else pure Python),
``native`` (the same, but a missing core is logged as a warning) or ``python`` (force the
pure-Python index and hashing, e.g. to compare or to rule the C code out). Both implementations
behave identically; the compiled one is several times faster on the router's hot paths.

``DYN_REQUIRE_NATIVE=1`` (CI sets it, as does its build, setup.py): a core that cannot be imported
is an error, not a fallback, so a broken compile fails the run instead of skipping the native
tests. ``DYN_KV_INDEX_IMPL=python`` still runs the pure-Python path without asking for the core.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

IMPL_ENV = "DYN_KV_INDEX_IMPL"
IMPL_CHOICES = ("auto", "native", "python")
REQUIRE_ENV = "DYN_REQUIRE_NATIVE"


def native_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() == "1"


KV_CORE_MODULE = "dynamod.shared.kv._kvcore"


def import_core(module: str = KV_CORE_MODULE) -> tuple[ModuleType | None, str | None]:
    """The compiled ``module`` whatever the setting (tests run both), or None and why not; with
    ``DYN_REQUIRE_NATIVE=1`` a core that cannot be imported raises ImportError instead."""
    try:
        return importlib.import_module(module), None
    except ImportError as exc:
        if native_required():
            raise ImportError(
                f"{REQUIRE_ENV}=1 but the compiled core {module} cannot be imported: {exc}; "
                "rebuild with `pip install -v -e .` and read the compiler's error"
            ) from exc
        return None, str(exc)


def requested_impl() -> str:
    value = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if value not in IMPL_CHOICES:
        logger.warning("%s=%r is not one of %s; using auto", IMPL_ENV, value, "|".join(IMPL_CHOICES))
        return "auto"
    return value


def select_core(module: str) -> tuple[ModuleType | None, str | None]:
    """The compiled ``module`` to use under ``DYN_KV_INDEX_IMPL``, or None and why not."""
    impl = requested_impl()
    if impl == "python":
        return None, f"{IMPL_ENV}=python"
    found, error = import_core(module)
    if found is None:
        log = logger.warning if impl == "native" else logger.debug
        log("compiled core %s unavailable, using pure Python: %s", module, error)
    return found, error


core, unavailable_reason = select_core(KV_CORE_MODULE)
"""The compiled module in use, or None (then ``unavailable_reason`` says why)."""
