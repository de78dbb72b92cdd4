"""``dynamoctl trace`` and the console's Requests view against a real disaggregated ``dynamod up``
(one frontend, one prefill and one decode mocker worker; file discovery, TCP request plane).

What an operator relies on: the id a request was sent with (``x-request-id``) is enough to get its
timeline; it holds the frontend's, the prefill worker's and the decode worker's spans in one trace,
each worker's spans under the frontend call that reached it, inside the request's own span, whose
length matches what the client waited; the text reads at 80 columns; an unknown id is one line and
exit 1; and the console lists the request among the slowest and opens the same waterfall.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from textual.widgets import DataTable

from dynamod.console.collectors.connection import ClusterConnection
from dynamod.console.settings import ConsoleSettings
from dynamod.console.state.cluster import ClusterState
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.trace_screen import TraceScreen
from tests.console.pilot import row_keys, until
from tests.fixtures.daemons import Up
from tests.fixtures.servers import free_port
from tests.integration.frontend.test_frontend_support import clean_env

pytestmark = pytest.mark.timeout(90)

PROMPT = " ".join(f"In the beginning word {i} was spoken unto the land." for i in range(60))  # ~700 tokens
REQUEST_ID = "ctl-trace-0001"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, float]]:
    """The cluster, its discovery directory, and the traced request (sent once), with the seconds
    the client waited for it."""
    root = tmp_path_factory.mktemp("ctl-trace")
    port, file_kv = free_port(), root / "discovery"
    env = clean_env(file_kv) | {"DYN_TRACE_SAMPLE_RATE": "1.0"}
    up = Up([sys.executable, "-m", "dynamod.daemon.cli", "up", "--http-port", str(port), "--prefill-workers", "1",
             "--decode-workers", "1", "--speedup-ratio", "10", "--file-kv", str(file_kv), "--log-dir", str(root / "logs")],
            env)
    try:
        up.wait_up(60)
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        reply = httpx.post(f"{url}/v1/chat/completions", headers={"x-request-id": REQUEST_ID}, timeout=30,
                           json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16})
        waited = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-request-id"] == REQUEST_ID
        yield file_kv, url, waited
    finally:
        up.kill()


def dynamoctl(file_kv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(file_kv), "trace", *args],
                          env=clean_env(file_kv), capture_output=True, text=True, timeout=30)


def test_the_request_id_gives_one_trace_across_frontend_prefill_and_decode(cluster) -> None:
    file_kv, _, waited = cluster
    done = dynamoctl(file_kv, REQUEST_ID, "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    spans = got["spans"]
    assert got["request_id"] == REQUEST_ID and {s["trace_id"] for s in spans} == {got["trace_id"]}
    assert [s["start_unix_ns"] for s in spans] == sorted(s["start_unix_ns"] for s in spans)
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans)
    assert {"frontend", "prefill", "decode"} <= {s["component"] for s in spans}
    [root] = [s for s in spans if s["parent_id"] is None]
    assert root["component"] == "frontend"
    for s in spans:
        # parented within the trace, and inside the request's own span
        assert s["parent_id"] is None or s["parent_id"] in by_id, s
        assert root["start_unix_ns"] <= s["start_unix_ns"] <= s["end_unix_ns"] <= root["end_unix_ns"], s
    for s in spans:
        if s["component"] in ("prefill", "decode") and by_id.get(s["parent_id"] or "", {}).get("component") == "frontend":
            assert s["attributes"].get("worker_id"), s  # a worker's top span names its worker
    workers = {s["component"]: s["instance_id"] for s in spans if s["component"] in ("prefill", "decode")}
    assert len(set(workers.values())) == 2
    took_s = (root["end_unix_ns"] - root["start_unix_ns"]) / 1e9
    assert 0 < took_s <= waited


def test_the_text_waterfall_reads_at_80_columns(cluster) -> None:
    file_kv, _, _ = cluster
    done = dynamoctl(file_kv, REQUEST_ID)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].startswith(f"request {REQUEST_ID}  trace ")
    table = lines[lines.index("") + 1:]
    assert table[0].startswith("SPAN") and table[1].startswith("http-request")
    assert any(" prefill " in line for line in table) and any(" decode " in line for line in table)


def test_an_unknown_request_is_one_line(cluster) -> None:
    file_kv, _, _ = cluster
    done = dynamoctl(file_kv, "ctl-trace-nobody")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("dynamoctl: error: no spans for request ctl-trace-nobody: asked 1 frontend and ")
    assert len(done.stderr.strip().splitlines()) == 1


async def test_the_console_lists_the_request_and_opens_its_waterfall(cluster) -> None:
    file_kv, url, _ = cluster
    settings = ConsoleSettings(discovery="file", file_kv=str(file_kv), frontend_urls=[], probe_interval_s=0.5)
    state = ClusterState()
    app = ConsoleApp(state, connection=ClusterConnection(settings, state), refresh_s=0.1, initial_view="requests")
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.query_one("#requests-table", DataTable)
        await until(pilot, lambda: REQUEST_ID in row_keys(table), 20, what="the request among the slowest")
        assert state.requests.sources() == [f"{url}/v1/traces"]
        table.move_cursor(row=row_keys(table).index(REQUEST_ID))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, TraceScreen) and app.screen.trace is not None, 20,
                    what="the waterfall")
        screen = app.screen
        assert isinstance(screen, TraceScreen) and screen.trace is not None
        assert {"frontend", "prefill", "decode"} <= {s.component for s in screen.trace.spans}
        assert screen.query_one("#trace-table", DataTable).row_count == len(screen.trace.spans)
        await pilot.press("escape")
        await pilot.pause()
        assert len(app.screen_stack) == 1
