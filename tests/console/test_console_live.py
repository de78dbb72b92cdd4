"""The console driving a real local cluster of mocker workers: every action by key, and its effect
seen both in the console and in the cluster (a drained worker shows draining and gets no new
requests, a slept one wakes, a LoRA appears as a model, a cleared cache reports empty)."""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from rich.console import Console
from textual.widgets import DataTable, Input

from dynamod.console.collectors.connection import ClusterConnection
from dynamod.console.settings import ConsoleSettings
from dynamod.console.state.cluster import ClusterState
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.screens import ConfirmScreen, LoraLoadScreen, LoraUnloadScreen, SleepLevelScreen
from dynamod.shared.errors import UnavailableError
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.runtime.client import EndpointClient
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.console.live import NAMESPACE, MockerCluster, request_body
from tests.console.pilot import until
from tests.fixtures.lora import make_adapter

SIZE = (120, 30)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockerCluster]:
    with MockerCluster(tmp_path_factory.mktemp("live-console"), workers=3).start() as c:
        yield c


@pytest.fixture
async def generate_client(cluster: MockerCluster) -> AsyncIterator[EndpointClient]:
    """The request side: a client of the workers' generate endpoint, as a frontend holds one."""
    rt = await DistributedRuntime.create(cluster.runtime_settings(), events=False)
    client = await rt.namespace(NAMESPACE).component("backend").endpoint("generate").client()
    try:
        yield client
    finally:
        await client.close()
        await rt.shutdown(grace_s=0.0)


def console(cluster: MockerCluster) -> ConsoleApp:
    settings = ConsoleSettings(discovery="file", file_kv=cluster.file_kv, frontend_urls=[], probe_interval_s=0.5)
    state = ClusterState()
    return ConsoleApp(state, connection=ClusterConnection(settings, state), refresh_s=0.1)


def status_cell(app: ConsoleApp, iid: int) -> str:
    table = app.query_one("#workers-table", DataTable)
    key = f"{NAMESPACE}/backend/{worker_id_hex(iid)}"
    return str(table.get_cell(key, "STATUS"))


@asynccontextmanager
async def ready_console(cluster: MockerCluster) -> AsyncIterator[tuple[ConsoleApp, Any, list[int]]]:
    """The console running on ``cluster`` once it shows every worker with its load: (app, its
    pilot, the workers' ids)."""
    app = console(cluster)
    async with app.run_test(size=SIZE) as pilot:
        ids = await cluster.read_instance_ids()
        await until(pilot, lambda: all((w := app.state.find_worker(i)) is not None and w.stats.loads for i in ids),
                    what="every worker with its load")
        await pilot.pause(0.2)
        yield app, pilot, ids


async def select(app: ConsoleApp, pilot, iid: int) -> None:
    table = app.query_one("#workers-table", DataTable)
    await until(pilot, lambda: f"{NAMESPACE}/backend/{worker_id_hex(iid)}" in [r.key.value for r in table.ordered_rows], what="row")
    table.move_cursor(row=table.get_row_index(f"{NAMESPACE}/backend/{worker_id_hex(iid)}"))
    await pilot.pause()
    assert app.selected_worker_id() == iid


async def send(client: EndpointClient, n: int, *, instance_id: int | None = None) -> None:
    async def one() -> None:
        mode = "direct" if instance_id is not None else "round-robin"
        async for _ in client.generate(request_body(), mode=mode, instance_id=instance_id, timeout_s=30):
            pass

    await asyncio.gather(*(one() for _ in range(n)))


async def test_drained_worker_shows_draining_and_gets_no_new_requests(cluster: MockerCluster, generate_client: EndpointClient) -> None:
    async with ready_console(cluster) as (app, pilot, ids):
        target, others = ids[0], ids[1:]
        await select(app, pilot, target)
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: status_cell(app, target) == "draining", what="the table to show draining")
        assert app.state.recent_events(kinds=["drain"])[0].instance_id == target
        # The request side stops routing to it as soon as discovery says so.
        await generate_client.instance_set.wait_for(lambda insts: not any(i.instance_id == target and i.routable for i in insts), 10)
        before = {i: app.state.find_worker(i).stats.kv_events for i in ids}
        await send(generate_client, 6)
        await until(pilot, lambda: all(app.state.find_worker(i).stats.kv_events > before[i] for i in others),
                    what="the other workers to report the new requests' KV blocks")
        assert app.state.find_worker(target).stats.kv_events == before[target]
        with pytest.raises(UnavailableError):
            await send(generate_client, 1, instance_id=target)
        # Wake returns a drained worker to service.
        await pilot.press("w")
        await until(pilot, lambda: status_cell(app, target) == "ready", what="the worker back to ready")


async def test_slept_worker_wakes(cluster: MockerCluster) -> None:
    async with ready_console(cluster) as (app, pilot, ids):
        target = ids[1]
        await select(app, pilot, target)
        await pilot.press("s")
        assert isinstance(app.screen, SleepLevelScreen)
        await pilot.press("1", "y")
        await until(pilot, lambda: status_cell(app, target) == "sleeping", what="sleeping")
        await pilot.press("w")
        await until(pilot, lambda: status_cell(app, target) == "ready", what="awake")
        kinds = [e.kind for e in app.state.recent_events() if e.instance_id == target]
        assert "sleep" in kinds and "wake" in kinds
        assert not [e for e in app.state.recent_events(kinds=["action"]) if e.severity == "error"]


async def test_lora_appears_as_a_model_and_goes_away(cluster: MockerCluster) -> None:
    async with ready_console(cluster) as (app, pilot, ids):
        target = ids[2]
        await select(app, pilot, target)
        await pilot.press("l")
        assert isinstance(app.screen, LoraLoadScreen)
        app.screen.query_one("#lora-name", Input).value = "sql-adapter"
        # Inside the workers' --lora-root (live.py sets DYN_LORA_ROOT): other sources are refused.
        source = make_adapter(cluster.root / "adapters", "sql").resolve()
        app.screen.query_one("#lora-source", Input).value = f"file://{source}"
        app.screen.query_one("#lora-source", Input).focus()
        await pilot.press("enter")
        await until(pilot, lambda: "sql-adapter" in app.state.models(), what="the LoRA model card")
        model = app.state.models()["sql-adapter"]
        assert model.is_lora and model.workers == {target}
        await pilot.press("3")
        models = app.query_one("#models-table", DataTable)
        await until(pilot, lambda: "sql-adapter" in [r.key.value for r in models.ordered_rows], what="the Models row")
        await pilot.press("2")
        await select(app, pilot, target)
        await pilot.press("u")
        assert isinstance(app.screen, LoraUnloadScreen)
        await pilot.press("enter", "y")
        await until(pilot, lambda: "sql-adapter" not in app.state.models(), what="the LoRA to go away")
        assert [e.kind for e in app.state.recent_events(kinds=["lora"])] == ["lora", "lora"]


async def test_clear_kv_empties_the_cache(cluster: MockerCluster, generate_client: EndpointClient) -> None:
    async with ready_console(cluster) as (app, pilot, ids):
        target = ids[2]
        await send(generate_client, 2, instance_id=target)
        await until(pilot, lambda: app.state.find_worker(target).stats.cached_blocks > 0, what="cached blocks")
        await select(app, pilot, target)
        await pilot.press("c", "y")
        await until(pilot, lambda: app.state.recent_events(kinds=["kv"]), what="the KV cleared event")
        assert app.state.find_worker(target).stats.cached_blocks == 0
        ok = app.state.recent_events(kinds=["action"])[0]
        assert ok.severity == "info" and "clear-kv" in ok.message


async def test_action_error_is_shown(cluster: MockerCluster) -> None:
    """Draining a sleeping worker is refused by the worker; the console says why."""
    async with ready_console(cluster) as (app, pilot, ids):
        target = ids[0]
        await select(app, pilot, target)
        await pilot.press("s", "1", "y")
        await until(pilot, lambda: status_cell(app, target) == "sleeping", what="sleeping")
        await pilot.press("d", "y")
        await until(pilot, lambda: any(e.severity == "error" for e in app.state.recent_events(kinds=["action"])), what="the error")
        err = next(e for e in app.state.recent_events(kinds=["action"]) if e.severity == "error")
        assert "wake it before draining" in err.message
        await pilot.press("w")
        await until(pilot, lambda: status_cell(app, target) == "ready", what="awake")


async def test_a_console_started_after_traffic_shows_the_cached_blocks(cluster: MockerCluster,
                                                                        generate_client: EndpointClient) -> None:
    """Issue 24 item 11: the worker cached blocks before this console subscribed to KV events; it
    reads them from the worker's kv_dump at start instead of showing 0 until the next event."""
    target = (await cluster.read_instance_ids())[1]
    await send(generate_client, 3, instance_id=target)  # three new prompts of two full blocks each
    app = console(cluster)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: (w := app.state.find_worker(target)) is not None and w.stats.kv_seeded,
                    what="the kv_dump seed")
        assert app.state.find_worker(target).stats.cached_blocks >= 6
        await select(app, pilot, target)
        await pilot.press("enter")
        shown = app.screen.query_one("#facts").content  # the worker detail's facts table
        text = Console(width=80, file=io.StringIO(), record=True)
        text.print(shown)
        cached = app.state.find_worker(target).stats.cached_blocks
        assert re.search(rf"cached blocks\s+{cached}\b", text.export_text()), text.export_text()
