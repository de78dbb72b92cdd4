"""The waterfall layout ``dynamoctl trace`` prints and the console draws (``console/waterfall.py``):
parenting, ordering, bar scaling and width, on the recorded migrated request and on small traces
built to pin one property each; and the span contract's checks (``state/traces.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamod.console.state.traces import RequestBoard, Span, SpanError, parse_span, parse_spans, parse_summary
from dynamod.console.state.versions import Versions
from dynamod.console.waterfall import (
    BAR,
    bar_cells,
    fmt_duration,
    header_lines,
    layout,
    render_text,
    short_worker,
    span_tree,
    text_lines,
)
from tests.console import trace_fakes

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
MS = 1_000_000
REAL = Path(__file__).parent / "fixtures" / "trace_real_disagg.json"


def mk(n: int, parent: int | None, start_ms: float, end_ms: float, name: str = "", component: str = "frontend",
       status: str = "ok", worker: str | None = None) -> Span:
    return parse_span({
        "trace_id": TRACE, "span_id": f"{n:016x}", "parent_id": f"{parent:016x}" if parent is not None else None,
        "name": name or f"span{n}", "component": component, "instance_id": worker,
        "start_unix_ns": 10**18 + int(start_ms * MS), "end_unix_ns": 10**18 + int(end_ms * MS), "status": status,
        "attributes": {"request_id": "r1", "model": "m"} | ({"worker_id": worker} if worker else {}),
    })


def recorded_spans() -> list[Span]:
    fx = trace_fakes.load()
    raw = fx["frontend"] + [s for spans in fx["workers"].values() for s in spans]
    spans, notes = parse_spans(raw, "fixture")
    assert notes == []
    return spans


def test_children_follow_their_parent_in_start_order_whatever_order_they_arrive_in() -> None:
    spans = [mk(4, 1, 50, 60), mk(3, 2, 12, 20), mk(1, None, 0, 100), mk(2, 1, 10, 40), mk(5, 1, 30, 35)]
    order = [(s.span_id[-1], depth) for s, depth, _ in span_tree(reversed(spans))]
    assert order == [("1", 0), ("2", 1), ("3", 2), ("5", 1), ("4", 1)]


def test_a_span_whose_parent_was_not_gathered_is_shown_at_the_top_marked_orphan() -> None:
    tree = span_tree([mk(1, None, 0, 100), mk(2, 99, 10, 20), mk(3, 2, 11, 12)])
    assert [(s.span_id[-1], d, orphan) for s, d, orphan in tree] == [("1", 0, False), ("2", 0, True), ("3", 1, False)]


def test_a_parent_loop_still_shows_every_span_once() -> None:
    tree = span_tree([mk(1, 2, 0, 10), mk(2, 1, 1, 5), mk(3, 3, 2, 3)])
    assert sorted(s.span_id[-1] for s, _, _ in tree) == ["1", "2", "3"]


def test_the_recorded_trace_nests_worker_spans_under_the_frontend_call_that_made_them() -> None:
    wf = layout(recorded_spans(), 80)
    rows = [(r.depth, r.span.name, r.component, r.worker) for r in wf.rows]
    assert rows[0] == (0, "http-request", "frontend", "3c1d5e7f")
    names = [r.span.name for r in wf.rows]
    # prefill stage -> the prefill worker's handler -> its queue and compute
    i = names.index("prefill")
    assert rows[i + 1:i + 4] == [(2, "handle_payload", "prefill", "7a3f00c2"), (3, "engine.queue", "prefill", "7a3f00c2"),
                                 (3, "engine.prefill", "prefill", "7a3f00c2")]
    # the migration sits between the failed attempt on one decode worker and the one on the other
    attempts = [(r.span.status, r.worker) for r in wf.rows if r.span.name == "client_request"]
    assert attempts == [("error", "5e21a9f0"), ("ok", "9b8c7d6e")]
    assert names.index("migration") > names.index("engine.decode")
    assert len(wf.rows) == 19  # 8 frontend + 3 prefill + 4 + 4 decode spans, each once


def test_bars_are_placed_and_sized_on_the_whole_trace() -> None:
    # 0..100 ms over 40 cells: 2.5 ms per cell
    assert bar_cells(0, 100, 0, 100, 40) == (0, 40)
    assert bar_cells(50, 100, 0, 100, 40) == (20, 20)
    assert bar_cells(10, 11, 0, 100, 40) == (4, 1)  # short spans keep one cell
    assert bar_cells(100, 100, 0, 100, 40) == (39, 1)  # an instant at the very end stays inside
    assert bar_cells(0, 0, 0, 0, 40) == (0, 1)  # a zero-length trace
    wf = layout([mk(1, None, 0, 100), mk(2, 1, 0, 50), mk(3, 1, 50, 100), mk(4, 1, 75, 76)], 79)
    assert wf.bar_width == 40  # short names: the bar takes the rest of the 79 columns
    root, first, second, blip = wf.rows
    assert (root.bar_start, root.bar_len) == (0, 40)
    assert (first.bar_start, first.bar_len) == (0, 20)
    assert (second.bar_start, second.bar_len) == (20, 20)
    assert (blip.bar_start, blip.bar_len) == (30, 1)


@pytest.mark.parametrize("width", (60, 80, 120))
def test_every_line_fits_the_width_and_the_bars_line_up(width: int) -> None:
    spans = recorded_spans()
    text = render_text("req-7f3a9c", TRACE, spans, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    wf = layout(spans, width)
    table = text_lines(wf)
    bar_col = sum(wf.widths[:4]) + 4  # four columns and their one-cell gaps
    for line, row in zip(table[1:], wf.rows, strict=True):
        assert line[bar_col:].lstrip(" ") == BAR * row.bar_len
        assert len(line) - bar_col == row.bar_start + row.bar_len
    if width >= 80:  # names are not cut at 80 columns
        assert all("…" not in r.label for r in wf.rows)


def test_the_80_column_text_reads_as_expected() -> None:
    lines = render_text("req-7f3a9c", TRACE, recorded_spans(), 80).splitlines()
    assert lines[0].startswith("request req-7f3a9c  trace 4bf92f3577b34da6a3ce929d0e0e4736")
    assert "took 612.4ms" in "\n".join(lines[:3]) and "migrated yes" in "\n".join(lines[:3])
    assert "workers 7a3f00c2 (prefill), 5e21a9f0 (decode), 9b8c7d6e (decode)" in "\n".join(lines[:3])
    header = next(line for line in lines if line.startswith("SPAN"))
    assert header.split()[:4] == ["SPAN", "COMP", "WORKER", "TIME"] and header.endswith("612.4ms")
    failed = next(line for line in lines if "engine.decode !" in line)
    assert "5e21a9f0" in failed and "140.0ms" in failed


def test_a_worker_the_frontend_reached_but_that_gave_no_span_is_named_in_the_header() -> None:
    """A migration's old worker was killed and its spans with it: the header still names it."""
    spans = [s for s in recorded_spans() if s.instance_id != "5e21a9f0c4d3b287"]
    header = "\n".join(header_lines("req-7f3a9c", TRACE, spans, 80))
    assert "workers 7a3f00c2 (prefill), 9b8c7d6e (decode), 5e21a9f0 (no spans)" in header


def test_long_names_are_cut_and_deep_trees_stay_readable() -> None:
    spans = [mk(1, None, 0, 10, name="x" * 60)] + [mk(i, i - 1, i / 2, 10, name=f"level{i}") for i in range(2, 14)]
    wf = layout(spans, 80)
    assert wf.rows[0].label.endswith("…") and len(wf.rows[0].label) == wf.name_width
    assert all(len(r.label) <= wf.name_width for r in wf.rows)
    assert max(len(line) for line in text_lines(wf)) <= 80


def test_durations_and_worker_ids_are_short() -> None:
    assert fmt_duration(1_500_000) == "1.5ms"
    assert fmt_duration(999_940_000) == "999.9ms"
    assert fmt_duration(12_340_000_000) == "12.34s"
    assert fmt_duration(250_000_000_000) == "250s"
    assert short_worker("00000000000000d2") == "d2"
    assert short_worker("7a3f00c2d9e1b456") == "7a3f00c2"
    assert short_worker(None) == "-"


def test_header_packs_into_lines_of_the_width() -> None:
    lines = header_lines("req-" + "9" * 70, TRACE, recorded_spans(), 80)
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].endswith("…")


def test_spans_breaking_the_contract_are_left_out_with_the_field_named() -> None:
    good = trace_fakes.load()["frontend"][0]
    bad = [{**good, "span_id": "xyz"}, {**good, "component": "gpu"}, {**good, "end_unix_ns": good["start_unix_ns"] - 1},
           {**good, "start_unix_ns": True}, "nope"]
    spans, notes = parse_spans([good, *bad], "http://f/v1/traces")
    assert len(spans) == 1
    assert [n.split(": ", 2)[2].split(" ")[0] for n in notes] == ["span_id", "component", "end_unix_ns", "start_unix_ns", "not"]
    assert parse_spans({"data": []}, "w")[1] == ["w: spans is dict, not a list"]
    with pytest.raises(SpanError, match="parent_id"):
        parse_span({**good, "parent_id": 12})


def test_the_board_merges_frontends_and_keeps_the_longer_figure_of_a_shared_request() -> None:
    fx = trace_fakes.load()
    versions = Versions()
    board = RequestBoard(versions, lambda: 5.0)
    for url, rows in fx["slowest"].items():
        board.apply(url, [parse_summary(r, url) for r in rows])
    slowest = board.slowest()
    assert [r.request_id for r in slowest] == ["req-7f3a9c", "chatcmpl-4e1f0b2a9c8d7e6f5a4b3c2d1e0f9a8b", "req-5d21",
                                               "req-91aa", "req-0c44"]
    assert slowest[-1].duration_ms == 99.0
    before = versions.requests
    board.failed(trace_fakes.SECOND_FRONTEND_URL, "no answer from it")
    assert versions.requests == before + 1
    assert "req-91aa" not in [r.request_id for r in board.slowest()]
    assert board.problems() == ["no answer from it"]
    board.forget(trace_fakes.SECOND_FRONTEND_URL)
    assert board.problems() == [] and board.sources() == [trace_fakes.FRONTEND_URL]


def test_a_trace_recorded_from_a_real_disaggregated_cluster_lays_out_under_its_root() -> None:
    """``dynamoctl trace --json`` of one request on `dynamod up --prefill-workers 1 --decode-workers 1`
    (``fixtures/trace_real_disagg.json``): each worker's spans under the frontend call that reached
    it, everything under the request's span, 80 columns."""
    recorded = json.loads(REAL.read_text())
    spans, notes = parse_spans(recorded["spans"], "recording")
    assert notes == [] and len(spans) == 15
    wf = layout(spans, 80)
    by_id = {r.span.span_id: r for r in wf.rows}
    assert [r.depth for r in wf.rows if r.span.parent_id is None] == [0] and wf.rows[0].span.name == "http-request"
    for r in wf.rows:
        if r.component in ("prefill", "decode"):
            parent = by_id[r.span.parent_id or ""]
            assert parent.depth == r.depth - 1
            top = r
            while top.component != "frontend":
                top = by_id[top.span.parent_id or ""]
            assert top.span.name in ("prefill", "client_request"), r.span.name
    assert not any(r.orphan for r in wf.rows)
    lines = render_text(recorded["request_id"], recorded["trace_id"], spans, 80).splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "workers 2b811f64 (prefill), 1d1b15ae (decode)" in "\n".join(lines[:3])
