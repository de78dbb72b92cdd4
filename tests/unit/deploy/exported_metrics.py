"""The Prometheus series the daemons export, read from their collectors rather than grepped.

Every class in ``dynamod.shared`` and ``dynamod.daemon`` whose constructor takes a single
``CollectorRegistry`` (``FrontendMetrics``, ``WorkerMetrics``, ``RouterMetrics``, the planner's,
...) is built on a fresh registry, plus ``DisaggMetrics`` with the two prefixes the frontend and
the router role give it. A new metrics class is picked up without touching this file. Modules that
cannot be imported here (an engine's library missing) are skipped: none of them defines metrics.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

PACKAGES = ("dynamod.shared", "dynamod.daemon")
# Constructors with arguments beyond the registry: the values the daemons pass.
EXTRA_ARGS = {"DisaggMetrics": ({"prefix": "dynamo_frontend"}, {"prefix": "dynamo_router"})}

_SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "unknown": ("",),
}


@dataclass
class ExportedMetrics:
    series: dict[str, str] = field(default_factory=dict)  # series name -> family name
    labels: dict[str, set[str]] = field(default_factory=dict)  # family name -> label names
    sources: dict[str, str] = field(default_factory=dict)  # family name -> class that registers it
    skipped_modules: dict[str, str] = field(default_factory=dict)


def _registry_constructors():
    seen = set()
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            try:
                module = importlib.import_module(info.name)
            except Exception as exc:  # noqa: BLE001 - an optional engine's library; reported, not fatal
                yield info.name, None, f"{type(exc).__name__}: {exc}"
                continue
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ != module.__name__ or cls in seen:
                    continue
                seen.add(cls)
                try:
                    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
                except (TypeError, ValueError):
                    continue
                required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                if not required or "CollectorRegistry" not in str(required[0].annotation):
                    continue
                if len(required) == 1:
                    yield module.__name__, cls, [{}]
                elif cls.__name__ in EXTRA_ARGS:
                    yield module.__name__, cls, list(EXTRA_ARGS[cls.__name__])


def exported_metrics() -> ExportedMetrics:
    out = ExportedMetrics()
    for module_name, cls, kwargs_list in _registry_constructors():
        if cls is None:
            out.skipped_modules[module_name] = kwargs_list
            continue
        for kwargs in kwargs_list:
            registry = CollectorRegistry()
            cls(registry, **kwargs)
            for collector in list(registry._collector_to_names):  # noqa: SLF001 - no public listing
                labelnames = set(getattr(collector, "_labelnames", ()))
                describe = getattr(collector, "describe", None)
                for family in (describe() if describe else None) or collector.collect():
                    out.labels.setdefault(family.name, set()).update(labelnames)
                    out.sources.setdefault(family.name, f"{cls.__module__}.{cls.__name__}")
                    for suffix in _SERIES_SUFFIXES.get(family.type, ("",)):
                        out.series[family.name + suffix] = family.name
    return out
