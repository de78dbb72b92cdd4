"""DistributedRuntime's own repairs found in review (each test fails without its repair): a busy
status port releases the half-built runtime, and an advertised (not served) instance exports no
request metrics. Its event publishers advertising its ``--host``:
tests/unit/transport/test_advertised_addresses.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.file import FileStore
from dynamod.shared.errors import ConfigError
from dynamod.shared.runtime.distributed import DistributedRuntime


async def test_busy_status_port_releases_the_half_built_runtime(tmp_path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    root = str(tmp_path / "kv")
    settings = RuntimeSettings(
        discovery_backend="file", file_kv=root, event_plane="zmq", system_port=holder.getsockname()[1]
    )
    before = asyncio.all_tasks()
    try:
        with pytest.raises(ConfigError, match="--system-port"):
            await DistributedRuntime.create(settings)
        # Nothing left running: no lease keep-alive, no watcher, and the lease is gone from disk.
        leftover = [t for t in asyncio.all_tasks() - before if not t.done()]
        assert leftover == []
        reader = FileStore(root)
        await reader.start()
        try:
            assert await reader.get_prefix("") == {}
            leases = await asyncio.to_thread(lambda: [p.name for p in (tmp_path / "kv").rglob("*.lease")])
            assert leases == []
        finally:
            await reader.close()
    finally:
        holder.close()


async def test_advertised_instances_export_no_component_request_metrics() -> None:
    """Only request-plane handlers get dynamo_component_* series; the frontend's HTTP instance
    (advertised, not served) would otherwise export request counters that stay at zero."""
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq"))
    try:
        await rt.namespace("ns").component("frontend").endpoint("http").advertise(
            transport="http", address="127.0.0.1:8000"
        )
        series = [
            s.labels
            for metric in rt.registry.collect()
            for s in metric.samples
            if metric.name.startswith("dynamo_component") and s.labels.get("dynamo_component") == "frontend"
        ]
        assert series == []
    finally:
        await rt.shutdown(0)
