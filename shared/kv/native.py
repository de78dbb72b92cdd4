"""Finds the compiled KV core (``dynamod.shared.kv._kvcore``, shared/kv/_native/kvcore.c) and
decides whether to use it.

``DYN_KV_INDEX_IMPL``: ``auto`` (default: the compiled core when it was built, else pure Python),
``native`` (the same, but a missing core is logged as a warning) or ``python`` (force the
pure-Python index and hashing, e.g. to compare or to rule the C code out). Both implementations
behave identically; the compiled one is several times faster on the router's hot paths.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

IMPL_ENV = "DYN_KV_INDEX_IMPL"
IMPL_CHOICES = ("auto", "native", "python")


def import_core() -> tuple[ModuleType | None, str | None]:
    """The compiled module whatever the setting (tests run both), or None and why not."""
    try:
        return importlib.import_module("dynamod.shared.kv._kvcore"), None
    except ImportError as exc:
        return None, str(exc)


def requested_impl() -> str:
    value = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if value not in IMPL_CHOICES:
        logger.warning("%s=%r is not one of %s; using auto", IMPL_ENV, value, "|".join(IMPL_CHOICES))
        return "auto"
    return value


def _select() -> tuple[ModuleType | None, str | None]:
    impl = requested_impl()
    if impl == "python":
        return None, f"{IMPL_ENV}=python"
    module, error = import_core()
    if module is None:
        log = logger.warning if impl == "native" else logger.debug
        log("kv compiled core unavailable, using pure Python: %s", error)
    return module, error


core, unavailable_reason = _select()
"""The compiled module in use, or None (then ``unavailable_reason`` says why)."""
