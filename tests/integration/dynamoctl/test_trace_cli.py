"""``dynamoctl trace`` as a process against fake endpoints on the real planes: file discovery, three
workers serving the ``traces`` control endpoint over the TCP request plane (each answering from
the recorded spans of one worker of ``tests/console/fixtures/trace_disagg.json``), one worker too old
to serve it, and a frontend (a small HTTP server with an API key) found through its discovery
record's ``metrics_url``, as the console's scraper finds frontends.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.protocol import control
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.transport.plane import RequestContext
from tests.console import trace_fakes

pytestmark = pytest.mark.timeout(60)

KEY = "trace-key-0123456789abcdef"
RID = "req-7f3a9c"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def frontend() -> Iterator[tuple[str, list[str]]]:
    """A frontend's ``/v1/traces`` (API key required) on a free port; yields its base URL and the
    paths it was asked for."""
    spans = trace_fakes.load()["frontend"]
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            asked.append(f"{self.headers.get('Host', '').split(':')[0]} {self.path}")
            url = urlparse(self.path)
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                return self._reply(401, {"error": {"message": "invalid API key"}})
            if url.path != "/v1/traces":
                return self._reply(404, {"error": {"message": "not found"}})
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            self._reply(200, {"object": "list", "data": trace_fakes.select(spans, q.get("request_id"), q.get("trace_id"))})

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
async def cluster(tmp_path: Path, frontend: tuple[str, list[str]]) -> AsyncIterator[tuple[Path, list[str]]]:
    """Three workers serving ``traces`` and one serving only ``generate``, plus the frontend's
    discovery record; yields the discovery directory and the workers' hex ids."""
    file_kv = tmp_path / "kv"
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(file_kv), event_plane="zmq")
    runtimes: list[DistributedRuntime] = []
    fx = trace_fakes.load()

    def answer(spans: list[dict[str, Any]]):  # noqa: ANN202 - an async generator handler
        async def handler(body: dict[str, Any], ctx: RequestContext):  # noqa: ANN202
            chosen = trace_fakes.select(spans, body.get("request_id"), body.get("trace_id"), body.get("limit", 100))
            yield control.ok(f"{len(chosen)} spans", spans=chosen)

        return handler

    async def noop(body: Any, ctx: RequestContext):  # noqa: ANN202
        yield {}

    try:
        hex_ids = []
        for role, spans in zip(("prefill", "decode", "decode"), fx["workers"].values(), strict=True):
            rt = await DistributedRuntime.create(settings)
            runtimes.append(rt)
            comp = rt.namespace().component("prefill" if role == "prefill" else "backend")
            await comp.endpoint("generate").serve(noop, role=role)
            await comp.endpoint(control.TRACES).serve(answer(spans), role=role)
            hex_ids.append(f"{rt.instance_id:016x}")
        old = await DistributedRuntime.create(settings)
        runtimes.append(old)
        await old.namespace().component("backend").endpoint("generate").serve(noop, role="decode")
        hex_ids.append(f"{old.instance_id:016x}")
        front = await DistributedRuntime.create(settings)
        runtimes.append(front)
        url, _ = frontend
        await front.namespace().component("frontend").endpoint("http").advertise(
            transport="http", address=url.removeprefix("http://"), role="frontend", labels={"metrics_url": f"{url}/metrics"})
        yield file_kv, hex_ids
    finally:
        for rt in runtimes:
            await rt.shutdown(grace_s=0.0)


async def dynamoctl(file_kv: Path, frontend_url: str, *args: str, key: str | None = KEY) -> tuple[int, str, str]:
    """Runs ``dynamoctl trace``. ``--frontend-url`` names the fake frontend a second time (as
    ``localhost``), which also keeps dynamoctl from trying a `dynamod up` frontend on this host:
    two frontends holding the same spans, as members of a fleet would."""
    env = {"PATH": "/usr/bin:/bin", "DYN_LOG": "warning"} | ({"DYN_API_KEY": key} if key else {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(file_kv), "--timeout", "10", "trace",
        "--frontend-url", frontend_url.replace("127.0.0.1", "localhost"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 45)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_json_has_every_process_spans_of_the_trace_once_sorted(cluster, frontend) -> None:
    file_kv, hex_ids = cluster
    code, out, err = await dynamoctl(file_kv, frontend[0], RID, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert (got["request_id"], got["trace_id"]) == (RID, TRACE)
    spans = got["spans"]
    assert len(spans) == len({s["span_id"] for s in spans}) == 19
    assert [s["start_unix_ns"] for s in spans] == sorted(s["start_unix_ns"] for s in spans)
    assert {s["component"] for s in spans} == {"frontend", "prefill", "decode"}
    # the request id was followed to its trace: the KV transfers (no request id) are there
    assert sum(1 for s in spans if s["name"] == "kv_transfer") == 2
    # the frontend found in discovery (127.0.0.1) and the one named (localhost) were both asked,
    # with the key, by request then by trace; their common spans are in the answer once
    _, asked = frontend
    assert sorted(asked) == sorted(f"{host} /v1/traces?{q}" for host in ("127.0.0.1", "localhost")
                                   for q in (f"request_id={RID}", f"trace_id={TRACE}"))
    assert f"worker {hex_ids[-1]} (backend) does not serve traces: skipped" in err


async def test_text_is_one_waterfall_at_80_columns(cluster, frontend) -> None:
    file_kv, _ = cluster
    code, out, err = await dynamoctl(file_kv, frontend[0], RID)
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].startswith(f"request {RID}  trace {TRACE}")
    table = lines[lines.index("") + 1:]
    assert table[0].startswith("SPAN") and table[1].startswith("http-request")
    assert len(table) == 20
    assert any(line.startswith("      engine.decode !") for line in table)
    code, out, _ = await dynamoctl(file_kv, frontend[0], RID, "--width", "60")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 60


async def test_an_unknown_request_is_one_line_and_exit_1(cluster, frontend) -> None:
    file_kv, _ = cluster
    code, out, err = await dynamoctl(file_kv, frontend[0], "req-nobody")
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert lines == ["dynamoctl: error: no spans for request req-nobody: asked 2 frontends and 3 workers "
                     "(only recent, sampled requests are kept)"]


async def test_without_the_key_the_frontend_is_named_and_the_workers_spans_still_shown(cluster, frontend) -> None:
    file_kv, _ = cluster
    code, out, err = await dynamoctl(file_kv, frontend[0], RID, "--json", key=None)
    assert code == 0, err
    assert {s["component"] for s in json.loads(out)["spans"]} == {"prefill", "decode"}
    assert "the frontend wants a key; give --api-key-file (or DYN_API_KEY)" in err
