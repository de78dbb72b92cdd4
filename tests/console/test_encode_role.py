"""Encode workers (``dynamod --role encode``) in the console: a row of the Workers table with role
``encode``, the ``encode pool`` in the topology, and no part in the KV pools' figures (they hold
no KV), so an agg cluster with an encode pool still reads as aggregated."""

from __future__ import annotations

from textual.widgets import Static, Tree

from dynamod.console.present import status_table
from dynamod.console.tui.app import ConsoleApp
from dynamod.console.tui.screens import WorkerScreen
from dynamod.console.tui.views.workers import fit_columns
from dynamod.shared.protocol.keys import instance_key
from dynamod.shared.protocol.load import LoadMetrics
from tests.console.factories import NAMESPACE, make_instance, make_state, register
from tests.console.pilot import row_keys, until, workers_table

SIZE = (200, 30)  # wide enough for the ROLE column (the last one an agg table gives room)
WORKER, ENCODER = 0x11, 0x22


def _state():  # noqa: ANN202
    state, _ = make_state()
    register(state, WORKER)
    key = instance_key(NAMESPACE, "encoder", "encode", ENCODER)
    state.put_instance(key, make_instance(ENCODER, "encode", component="encoder", role="encode"))
    return state


async def test_encode_worker_in_workers_and_topology() -> None:
    state = _state()
    assert set(state.pools()) == {"agg"}
    app = ConsoleApp(state, initial_view="workers")
    async with app.run_test(size=SIZE) as pilot:
        table = workers_table(app)
        await until(pilot, lambda: len(row_keys(table)) == 2, what="two rows")
        key = next(k for k in row_keys(table) if k.endswith(f"{ENCODER:x}"))
        assert str(table.get_cell(key, "ROLE")) == "encode"
        table.move_cursor(row=table.get_row_index(key))
        await pilot.press("enter")  # its detail opens like any worker's
        assert isinstance(app.screen, WorkerScreen) and app.screen.instance_id == ENCODER
        title = app.screen.query_one("#title", Static)
        assert "ns/encoder/" in str(title.render())
        await pilot.press("escape")
        await pilot.press("1")
        tree = app.query_one("#topology", Tree)
        await until(pilot, lambda: any(str(n.label).startswith("encode pool") for n in tree._tree_nodes.values()),
                    what="the encode pool in the topology")


def test_encoder_and_embedding_figures_from_load_records() -> None:
    """An encoder's busy share and images/s, a VL worker's embedding hit rate: from their load
    records; a worker without images has no hit rate (not 0%)."""
    state = _state()
    worker, encoder = (state.topology.first_worker(i) for i in (WORKER, ENCODER))
    assert worker is not None and encoder is not None
    assert worker.stats.embedding_hit_rate is None and encoder.stats.encoder_busy is None
    state.apply_load(LoadMetrics(worker_id=ENCODER, encoder_busy=0.42, encode_images_per_s=3.5, encode_inflight_images=2))
    state.apply_load(LoadMetrics(worker_id=WORKER, num_running=1))
    assert worker.stats.embedding_hit_rate is None and worker.stats.embedding_lookups == 0
    state.apply_load(LoadMetrics(worker_id=WORKER, num_running=1, embedding_cache_hits=3, embedding_cache_misses=1))
    assert worker.stats.embedding_hit_rate == 0.75
    assert (encoder.stats.encoder_busy, encoder.stats.encode_images_per_s) == (0.42, 3.5)
    assert encoder.stats.embedding_hit_rate is None
    columns, rows = status_table(state)  # dynamoctl status: the encoder's KV figures are "-", not 0
    enc_row = dict(zip(columns, next(r for r in rows if r[0] == f"{ENCODER:016x}"), strict=True))
    assert (enc_row["ROLE"], enc_row["RUN"], enc_row["KV"], enc_row["HIT"]) == ("encode", "-", "-", "-")


def test_text_only_columns_unchanged() -> None:
    """Without encoder reports or embedding lookups, the table keeps the columns it had."""
    assert fit_columns(80, False, {}) == ("ID", "STATUS", "RUN", "WAIT", "KV", "HIT", "TTFT", "ITL", "LOAD")
    wide = fit_columns(300, False, {})
    assert not {"ENC%", "IMG/S", "EMB"} & set(wide)
    # With encoders, ROLE is kept (it tells the encoders apart) even at 80 columns.
    narrow = fit_columns(80, False, {}, encoders=True, embeddings=True)
    assert narrow[:3] == ("ID", "ROLE", "STATUS") and {"ENC%", "EMB", "TTFT"} <= set(narrow)
    assert {"ENC%", "IMG/S", "EMB", "TTFT", "ITL"} <= set(fit_columns(120, False, {}, encoders=True, embeddings=True))


async def test_workers_view_shows_encoder_busy_and_embedding_hit_rate() -> None:
    state = _state()
    app = ConsoleApp(state, initial_view="workers")
    async with app.run_test(size=(100, 30)) as pilot:
        table = workers_table(app)
        await until(pilot, lambda: len(row_keys(table)) == 2, what="two rows")
        assert "ENC%" not in table.columns and "EMB" not in table.columns  # no data yet: no columns
        state.apply_load(LoadMetrics(worker_id=ENCODER, encoder_busy=0.42, encode_images_per_s=3.5))
        state.apply_load(LoadMetrics(worker_id=WORKER, num_running=2, kv_usage=0.5, embedding_cache_hits=3,
                                     embedding_cache_misses=1))
        await until(pilot, lambda: "EMB" in table.columns and "ENC%" in table.columns, what="encode columns")
        enc_key = next(k for k in row_keys(table) if k.endswith(f"{ENCODER:016x}"))
        wk_key = next(k for k in row_keys(table) if k.endswith(f"{WORKER:016x}"))

        def cell(key: str, col: str) -> str:
            return str(table.get_cell(key, col))

        await until(pilot, lambda: cell(enc_key, "ENC%") == "42%", what="the encoder's busy share")
        assert (cell(enc_key, "IMG/S"), cell(enc_key, "EMB"), cell(enc_key, "KV"), cell(enc_key, "RUN")) == ("3.5/s", "-", "-", "-")
        assert (cell(wk_key, "EMB"), cell(wk_key, "ENC%"), cell(wk_key, "KV"), cell(wk_key, "RUN")) == ("75%", "-", "50%", "2")
        assert cell(enc_key, "ROLE") == "encode"
