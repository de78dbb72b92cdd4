"""Collectors created once per Prometheus registry.

prometheus-client refuses a second collector with a name already registered, yet several objects
in one process (one KV router per served model, a feed and a publisher per router) want the same
collectors on the same registry. ``PerRegistry(make)`` is the one memo they share: called with a
registry (the global one by default) it returns the collector set ``make`` built for that
registry the first time. Registries are kept by identity, and the registry is held beside its
set so that a new registry reusing a freed one's ``id`` is not handed the old collectors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry

M = TypeVar("M")


class PerRegistry(Generic[M]):
    """``make(registry)`` once per registry; thread-safe (routers hash on worker threads)."""

    def __init__(self, make: Callable[[CollectorRegistry], M]) -> None:
        self._make = make
        self._by_registry: dict[int, tuple[CollectorRegistry, M]] = {}
        self._lock = threading.Lock()

    def __call__(self, registry: CollectorRegistry | None = None) -> M:
        reg = REGISTRY if registry is None else registry
        with self._lock:
            entry = self._by_registry.get(id(reg))
            if entry is None or entry[0] is not reg:
                entry = (reg, self._make(reg))
                self._by_registry[id(reg)] = entry
            return entry[1]
