"""Gathering one request's trace (``console/actions/traces.py``) from recorded frontend and worker
answers: merge and dedupe, the request id followed to its trace id, sources that fail or are too
old skipped with a note, and a request nobody knows."""

from __future__ import annotations

import pytest

from dynamod.console.actions.traces import TraceGatherer, UnknownRequestError, merge_spans, pick_trace
from dynamod.console.collectors.scraper import Credential
from dynamod.console.state.traces import parse_spans
from tests.console import trace_fakes
from tests.console.trace_fakes import (
    FRONTEND_URL,
    SECOND_FRONTEND_URL,
    FakeFrontends,
    FakeWorkers,
    recorded_gatherer,
)

RID = "req-7f3a9c"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PREFILL, DECODE_1, DECODE_2 = "7a3f00c2d9e1b456", "5e21a9f0c4d3b287", "9b8c7d6e5f4a3b2c"


async def test_spans_of_every_process_come_back_once_sorted_by_start() -> None:
    fx = trace_fakes.load()
    frontends = FakeFrontends({FRONTEND_URL: fx["frontend"], SECOND_FRONTEND_URL: fx["frontend"]})  # a fleet: same spans twice
    workers = FakeWorkers(fx["workers"])
    gatherer = TraceGatherer(workers, lambda: [FRONTEND_URL, SECOND_FRONTEND_URL], frontends.http())  # type: ignore[arg-type]
    found = await gatherer.gather(RID)
    assert found.trace_id == TRACE
    assert found.notes == []
    assert found.sources == 5
    ids = [s.span_id for s in found.spans]
    assert len(ids) == len(set(ids)) == 19
    starts = [s.start_unix_ns for s in found.spans]
    assert starts == sorted(starts)
    # The KV-transfer spans carry no request id: only asking by trace id finds them.
    assert [s.instance_id for s in found.spans if s.name == "kv_transfer"] == [DECODE_1, DECODE_2]
    assert {s.component for s in found.spans} == {"frontend", "prefill", "decode"}
    out = found.to_dict()
    assert list(out) == ["request_id", "trace_id", "spans"] and out["request_id"] == RID
    assert out["spans"][0]["name"] == "http-request" and out["spans"][0]["parent_id"] is None


async def test_the_second_round_asks_by_trace_id_with_a_limit() -> None:
    gatherer, frontends, workers = recorded_gatherer()
    await gatherer.gather(RID)
    bodies = [b for hex_id, b in workers.bodies if hex_id == PREFILL]
    assert bodies == [{"request_id": RID, "trace_id": None, "limit": 2000},
                      {"request_id": None, "trace_id": TRACE, "limit": 2000}]
    assert frontends.asked == [f"{FRONTEND_URL}?request_id={RID}", f"{FRONTEND_URL}?trace_id={TRACE}"]


async def test_an_unknown_request_is_one_line_naming_what_was_asked() -> None:
    gatherer, _, _ = recorded_gatherer()
    with pytest.raises(UnknownRequestError) as err:
        await gatherer.gather("req-nobody")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("no spans for request req-nobody: asked 1 frontend and 3 workers (")
    gatherer, _, _ = recorded_gatherer(failing=[PREFILL])
    with pytest.raises(UnknownRequestError, match="asked 1 frontend and 3 workers; 1 of them gave no answer"):
        await gatherer.gather("req-nobody")


async def test_workers_that_do_not_answer_fail_or_lack_the_endpoint_are_skipped_with_a_note() -> None:
    gatherer, _, _ = recorded_gatherer(silent=[DECODE_1], failing=[PREFILL], old=["00000000000000aa"])
    found = await gatherer.gather(RID)
    assert {s.instance_id for s in found.spans if s.component != "frontend"} == {DECODE_2}
    assert f"worker {DECODE_1}: no answer within 0.2s: skipped" in found.notes
    assert f"worker {PREFILL}: handler failed: ring buffer locked: skipped" in found.notes
    assert "worker 00000000000000aa (backend) does not serve traces: skipped" in found.notes
    assert len(found.notes) == 3  # a worker that failed both rounds is named once


async def test_a_frontend_that_is_down_costs_its_spans_and_a_note_unless_it_was_only_guessed() -> None:
    fx = trace_fakes.load()
    frontends = FakeFrontends({FRONTEND_URL: fx["frontend"]}, down=[SECOND_FRONTEND_URL])
    gatherer = TraceGatherer(FakeWorkers(fx["workers"]), lambda: [FRONTEND_URL, SECOND_FRONTEND_URL],  # type: ignore[arg-type]
                             frontends.http())
    found = await gatherer.gather(RID)
    assert len(found.spans) == 19
    assert found.notes == [f"no answer from {SECOND_FRONTEND_URL}: connection refused"]
    quiet = TraceGatherer(FakeWorkers(fx["workers"]), lambda: [FRONTEND_URL, SECOND_FRONTEND_URL],  # type: ignore[arg-type]
                          frontends.http(), guessed=frozenset({SECOND_FRONTEND_URL}))
    assert (await quiet.gather(RID)).notes == []


async def test_frontend_credentials_are_tried_in_turn() -> None:
    fx = trace_fakes.load()
    frontends = FakeFrontends({FRONTEND_URL: fx["frontend"]}, key="k-0123456789abcdef")
    creds = [Credential("cluster token", {"Authorization": "Bearer token-x"}),
             Credential("API key", {"Authorization": "Bearer k-0123456789abcdef"})]
    found = await TraceGatherer(FakeWorkers({}), lambda: [FRONTEND_URL], frontends.http(creds)).gather(RID)  # type: ignore[arg-type]
    assert [s.component for s in found.spans] == ["frontend"] * 8
    refused = await TraceGatherer(FakeWorkers(fx["workers"]), lambda: [FRONTEND_URL], frontends.http(creds[:1])).gather(RID)  # type: ignore[arg-type]
    assert refused.notes == [f"401 from {FRONTEND_URL}: the cluster token given was refused"]


def test_a_request_id_in_two_traces_shows_the_one_with_most_of_its_spans() -> None:
    fx = trace_fakes.load()
    spans, _ = parse_spans(fx["frontend"], "f")
    other = [{**s, "trace_id": "f" * 32, "span_id": "f" + s["span_id"][1:]} for s in fx["frontend"][:2]]
    extra, _ = parse_spans(other, "f")
    chosen, notes = pick_trace(RID, extra + spans)
    assert chosen == TRACE
    assert notes == [f"request {RID} also appears in trace {'f' * 32} (2 spans): showing trace {TRACE}"]


def test_merge_keeps_the_copy_that_ended_last() -> None:
    fx = trace_fakes.load()
    closed, _ = parse_spans(fx["frontend"][:1], "a")
    early = [{**fx["frontend"][0], "end_unix_ns": fx["frontend"][0]["start_unix_ns"] + 5}]
    still_open, _ = parse_spans(early, "b")
    assert merge_spans([still_open, closed]) == closed
    assert merge_spans([closed, still_open]) == closed
