"""Snapshots of every view at 80x24 (an SSH session's default) and 160x50, from the recorded
cluster with its clock frozen, so ages and figures are the same on every run.

Update after an intended visual change with ``pytest tests/console/test_snapshots.py --snapshot-update``
and look at the SVGs in ``__snapshots__/`` before committing them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from textual.pilot import Pilot

from dynamod.console.state.recording import read_records, replay
from dynamod.console.tui.app import ConsoleApp
from tests.console.factories import make_state, register
from tests.console.fixtures.make_recording import DECODE_2, WORKER_A, WORKER_B, WORKER_D
from tests.console.pilot import cursor_to_worker

VIEWS = ("topology", "workers", "models", "events", "router", "scaling")
SIZES = ((80, 24), (160, 50))


def _app(recording: list[dict], view: str = "workers", **kw) -> ConsoleApp:
    return ConsoleApp(replay(recording), initial_view=view, **kw)


def _on_worker_press(iid: int, key: str) -> Callable[[Pilot], Awaitable[None]]:
    """A ``run_before`` that puts the Workers table's cursor on ``iid`` and presses ``key``."""

    async def run_before(pilot: Pilot) -> None:
        await cursor_to_worker(pilot, iid)
        await pilot.press(key)
        await pilot.pause()

    return run_before


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("view", VIEWS)
def test_view(snap_compare, recording, view: str, size: tuple[int, int]) -> None:
    assert snap_compare(_app(recording, view), terminal_size=size)


def test_read_only_workers(snap_compare, recording) -> None:
    assert snap_compare(_app(recording, read_only=True), terminal_size=(80, 24))


def test_worker_detail(snap_compare, recording) -> None:
    assert snap_compare(_app(recording), run_before=_on_worker_press(WORKER_B, "enter"), terminal_size=(80, 24))


def test_confirm_drain(snap_compare, recording) -> None:
    assert snap_compare(_app(recording), run_before=_on_worker_press(WORKER_A, "d"), terminal_size=(80, 24))


def test_help(snap_compare, recording) -> None:
    assert snap_compare(_app(recording), press=["question_mark"], terminal_size=(80, 24))


def test_sleep_dialog(snap_compare, recording) -> None:
    """80x24: the sleep dialog's question wraps inside the dialog instead of being cut."""
    assert snap_compare(_app(recording), run_before=_on_worker_press(WORKER_A, "s"), terminal_size=(80, 24))


def test_sleep_confirm(snap_compare, recording) -> None:
    async def run_before(pilot: Pilot) -> None:
        await cursor_to_worker(pilot, WORKER_D)
        await pilot.press("s", "2")
        await pilot.pause()

    assert snap_compare(_app(recording), run_before=run_before, terminal_size=(80, 24))


def test_workers_status_changes_after_first_draw(snap_compare) -> None:
    """80x24: workers first drawn ``ready`` then turned ``draining``/``sleeping`` read in full
    (the table used to keep the column as wide as ``ready`` and cut them to ``draini``)."""
    state, _ = make_state()
    for iid in (0x11, 0x22, 0x33):
        register(state, iid)

    async def run_before(pilot: Pilot) -> None:
        await pilot.pause()
        register(state, 0x22, status="draining")
        register(state, 0x33, status="sleeping")
        pilot.app.refresh_now()
        await pilot.pause()

    assert snap_compare(ConsoleApp(state, initial_view="workers"), run_before=run_before, terminal_size=(80, 24))


def test_scale_dialog(snap_compare, disagg_recording) -> None:
    async def run_before(pilot: Pilot) -> None:
        await pilot.press("down", "r")
        await pilot.pause()

    assert snap_compare(_app(disagg_recording, "scaling"), run_before=run_before, terminal_size=(80, 24))


@pytest.mark.parametrize("view", ("topology", "workers", "router", "scaling"))
def test_disagg_view(snap_compare, disagg_recording, view: str) -> None:
    """A disaggregated cluster at 80x24: the pool strip, role and transfer columns, the two-stage
    router table with the remote/local prefill summary."""
    assert snap_compare(_app(disagg_recording, view), terminal_size=(80, 24))


def test_disagg_workers_wide(snap_compare, disagg_recording) -> None:
    assert snap_compare(_app(disagg_recording, "workers"), terminal_size=(160, 50))


def test_disagg_worker_detail(snap_compare, disagg_recording) -> None:
    """A decode worker's detail: its KV transfer figures and its recent decisions by stage."""
    assert snap_compare(_app(disagg_recording), run_before=_on_worker_press(DECODE_2, "enter"), terminal_size=(80, 24))


def _with_kv_tiers(recording: list[dict]) -> list[dict]:
    """The recorded cluster with host and disk KV tiers on worker A and a host tier on worker B:
    their load messages carry ``kv_tiers``, filling and counting up over the recording."""
    out = []
    for rec in recording:
        value = rec.get("value")
        if rec["kind"] == "kv_metrics" and value["worker_id"] in (WORKER_A, WORKER_B):
            step = int(rec["t"] - recording[0]["t"])
            tiers = {"CPU": {"blocks": min(40 * step, 3200), "total_blocks": 4096, "hit_tokens": 512 * step,
                             "onboarded_blocks": 6 * step, "offloaded_blocks": 40 * step}}
            if value["worker_id"] == WORKER_A:
                tiers["DISK"] = {"blocks": 12 * step, "total_blocks": 65536, "hit_tokens": 64 * step,
                                 "onboarded_blocks": step, "offloaded_blocks": 12 * step}
            rec = {**rec, "value": {**value, "kv_tiers": tiers}}
        out.append(rec)
    return out


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_workers_with_kv_tiers(snap_compare, recording, size: tuple[int, int]) -> None:
    """Workers with host/disk KV tiers gain a TIER% column after KV (``H78 D1``: only the tiers a
    worker has, "-" for one without)."""
    assert snap_compare(_app(_with_kv_tiers(recording)), terminal_size=size)


def test_worker_detail_with_kv_tiers(snap_compare, recording) -> None:
    assert snap_compare(_app(_with_kv_tiers(recording)), run_before=_on_worker_press(WORKER_A, "enter"),
                        terminal_size=(80, 24))


def test_scaling_plot(snap_compare) -> None:
    """80x24: a recorded `dynamod up --planner` burst: desired vs ready replicas against the load
    (request rate, queue) and TTFT/ITL against their targets, one column per planner interval."""
    from tests.console.test_scaling_live import SCALING_RECORDING

    assert snap_compare(_app(read_records(SCALING_RECORDING), "scaling"), terminal_size=(80, 24))
