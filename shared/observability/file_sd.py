"""Prometheus file-based service discovery (``file_sd_configs``) built from dynamod discovery.

Outside Kubernetes nothing tells Prometheus where a cluster's ``/metrics`` are: processes pick free
ports and register them under ``v1/instances/...``. This turns those records into the JSON
Prometheus reads from a ``file_sd_configs`` file: one target group per process (a worker registers
a dozen endpoints with one status server; one target), labelled so the dashboard and the rules in
``deploy/prometheus`` can group and filter:

- ``namespace``: the dynamod namespace (what ``namespace`` is on Kubernetes: the dashboard filter)
- ``component``: the discovery component (``backend``, ``prefill``, ``frontend``, ...)
- ``role``: ``frontend``, ``agg``, ``prefill``, ``decode``, ``planner``, ...
- ``worker_id``: the instance id in 16 hex digits, as the workers' own series name it
- ``model``: the served model (workers; a frontend serves every model and labels its series itself)
- ``worker_name``: the supervisor's name for the worker (``worker-0``) when it has one

plus ``__metrics_path__`` and ``__scheme__`` from the process's metrics URL. Used by
``dynamoctl targets --prometheus`` (one snapshot) and ``dynamod up --prometheus-sd`` (kept current).
The file is written atomically (temporary file + rename), as Prometheus re-reads it on change.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.protocol.keys import instances_prefix
from dynamod.shared.protocol.worker_id import worker_id_hex

METRICS_URL_LABEL = "metrics_url"  # a frontend advertises its /metrics under this label
WORKER_NAME_LABEL = "worker_name"

TargetGroup = dict[str, Any]  # {"targets": ["host:port"], "labels": {...}}: Prometheus' file_sd shape


def metrics_url(inst: Instance) -> str:
    """Where ``inst``'s process serves ``/metrics``: its ``metrics_url`` label (frontends), else
    its status server's ``system_url`` + ``/metrics``; empty when it serves none."""
    url = inst.labels.get(METRICS_URL_LABEL, "")
    if url:
        return url
    return f"{inst.system_url.rstrip('/')}/metrics" if inst.system_url else ""


def target_group(inst: Instance) -> TargetGroup | None:
    """The file_sd target group of ``inst``'s process, or None when it serves no metrics."""
    url = metrics_url(inst)
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    labels = {
        "__metrics_path__": parts.path or "/metrics",
        "__scheme__": parts.scheme,
        "namespace": inst.namespace,
        "component": inst.component,
        "role": inst.role or inst.component,
        "worker_id": worker_id_hex(inst.instance_id),
    }
    if inst.model:
        labels["model"] = inst.model
    if inst.labels.get(WORKER_NAME_LABEL):
        labels["worker_name"] = inst.labels[WORKER_NAME_LABEL]
    return {"targets": [f"{host}:{port}"], "labels": labels}


def target_groups(instances: Iterable[Instance]) -> list[TargetGroup]:
    """One group per scrape address (a process's endpoints share it), sorted by address so the
    file only changes when the cluster does."""
    by_address: dict[tuple[str, str], TargetGroup] = {}
    for inst in sorted(instances, key=lambda i: (i.namespace, i.component, i.endpoint, i.instance_id)):
        group = target_group(inst)
        if group is None:
            continue
        key = (group["targets"][0], group["labels"]["__metrics_path__"])
        by_address.setdefault(key, group)
    return [by_address[k] for k in sorted(by_address)]


async def read_instances(store: DiscoveryStore, namespace: str | None = None) -> list[Instance]:
    """Every instance record under ``v1/instances/[namespace/]``; undecodable ones skipped (a
    newer writer's record must not hide the rest)."""
    out = []
    for _key, raw in (await store.get_prefix(instances_prefix(namespace))).items():
        try:
            out.append(decode_instance(raw))
        except msgspec.DecodeError:
            continue
    return out


async def read_target_groups(store: DiscoveryStore, namespace: str | None = None) -> list[TargetGroup]:
    return target_groups(await read_instances(store, namespace))


def render(groups: list[TargetGroup]) -> str:
    return json.dumps(groups, indent=2, sort_keys=True) + "\n"


def write_file(path: str | os.PathLike[str], groups: list[TargetGroup]) -> bool:
    """Writes ``groups`` to ``path`` atomically when they differ from what is there; returns
    whether it wrote. Prometheus watches the file: a half-written one would drop every target."""
    target = Path(path)
    text = render(groups)
    try:
        if target.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # Prometheus often runs as its own user
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True
