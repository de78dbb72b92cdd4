"""ClusterState from recorded streams: the picture an operator relies on (statuses, events, hot
and slow workers, model figures, routing explanations) with no Textual and no network."""

from __future__ import annotations

import io
import json

import msgspec
import pytest

from dynamod.console.present import status_records
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.decisions import decode_router_decision
from dynamod.console.state.recording import ManualClock, RecordingSink, apply_record, read_records, replay
from dynamod.console.state.records import STATUS_GONE
from dynamod.console.state.topology import GONE_RETENTION_S
from dynamod.shared.protocol.keys import instance_key, mdc_key
from dynamod.shared.protocol.kv_events import KvCleared, KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.model_card import ModelCard
from tests.console.factories import make_instance, make_state, register
from tests.console.fixtures.make_recording import (
    FRONTEND,
    PREFILL_1,
    PREFILL_2,
    T0,
    WORKER_A,
    WORKER_B,
    WORKER_C,
    WORKER_D,
)

# -- the recorded picture --------------------------------------------------------------------------


def test_recording_statuses(recorded_state: ClusterState) -> None:
    status = {w.instance_id: w.status for w in recorded_state.workers.values()}
    assert status == {
        WORKER_A: "ready",
        WORKER_B: "ready",
        WORKER_C: "draining",
        WORKER_D: "sleeping",
        PREFILL_1: "ready",
        PREFILL_2: STATUS_GONE,
        FRONTEND: "ready",
    }
    # A worker registers nine endpoints; the console shows it once, with all nine under it.
    assert len(recorded_state.find_worker(WORKER_A).endpoints) == 9
    assert recorded_state.find_worker(WORKER_B).loras == {"sql-lora": "tiny"}
    assert not recorded_state.find_worker(FRONTEND).is_worker


def test_recording_events_newest_first(recorded_state: ClusterState) -> None:
    events = recorded_state.recent_events()
    assert [e.ts for e in events] == sorted((e.ts for e in events), reverse=True)
    kinds = [e.kind for e in events]
    # One registration per worker process, not one per endpoint.
    assert kinds.count("registered") == 7
    for kind in ("drain", "sleep", "lora", "expired", "scaling", "connection", "imbalance"):
        assert kind in kinds, kind
    drain = recorded_state.recent_events(kinds=["drain"])
    assert len(drain) == 1 and drain[0].instance_id == WORKER_C
    scaling = [e.message for e in recorded_state.recent_events(kinds=["scaling"])]
    assert any("dynamo/prefill: scale down 2 -> 1 (queue_low: prefill queue empty" in m for m in scaling)
    assert any(m.startswith("override dynamo/agg = 4 by ops@bastion") for m in scaling)


def test_event_filter_matches_any_word(recorded_state: ClusterState) -> None:
    hits = recorded_state.recent_events("sql-lora")
    assert hits and all("sql-lora" in e.message for e in hits)
    assert recorded_state.recent_events(f"{WORKER_C:x}")[0].kind == "drain"
    assert recorded_state.recent_events("no-such-thing") == []


def test_imbalance_names_the_hot_and_the_slow_worker(recorded_state: ClusterState) -> None:
    found = {(i.kind, i.instance_id) for i in recorded_state.imbalances}
    assert ("hot", WORKER_A) in found
    assert ("slow", WORKER_B) in found  # ITL 48 ms against peers at 12 ms
    hot = next(i for i in recorded_state.imbalances if i.kind == "hot")
    assert f"{WORKER_A:x}" in hot.message and "KV 93%" in hot.message
    # Each worker turning hot or slow was reported once, not at every tick.
    reported = recorded_state.recent_events(kinds=["imbalance"])
    assert len(reported) == len({(e.message.split(":")[0]) for e in reported})


def test_models_from_cards_and_frontend_metrics(recorded_state: ClusterState) -> None:
    models = recorded_state.models()
    assert set(models) == {"tiny", "sql-lora"}
    lora = models["sql-lora"]
    assert lora.is_lora and lora.base_model == "tiny" and lora.workers == {WORKER_B}
    tiny = models["tiny"]
    assert not tiny.is_lora
    assert PREFILL_2 not in tiny.workers  # gone workers do not serve
    s = tiny.stats
    assert s.request_rate == pytest.approx(40.0, rel=0.05)
    assert s.errors_total == 18 and s.migrations_total == 7
    # Recorded TTFT buckets put the median inside (0.025, 0.05] and p99 inside (0.25, 0.5].
    assert 0.025 < s.ttft_p50 <= 0.05
    assert 0.25 < s.ttft_p99 <= 0.5
    assert 0.005 < s.itl_p50 <= 0.01
    assert s.hit_rate == pytest.approx(0.55)  # cached / prompt tokens from the frontend
    # No frontend token counters for the adapter: its worker's own prefix hit rate stands in.
    assert lora.stats.hit_rate == pytest.approx(0.41)


def test_router_decision_explanations(recorded_state: ClusterState) -> None:
    last = recorded_state.decisions[-1]
    assert last.worker_id == WORKER_B
    text = last.explanation()
    assert text.startswith(f"picked {WORKER_B:x}: cost ")
    assert "prefill" in text and "decode" in text and "next " in text
    assert recorded_state.find_worker(WORKER_B).stats.routed >= 10


def test_sparkline_history_is_sampled_once_a_second(recorded_state: ClusterState) -> None:
    history = recorded_state.find_worker(WORKER_A).stats.history
    assert len(history) == 60  # one minute kept
    assert min(history) >= 16  # the hot worker: ~10 running + 7 waiting throughout


def test_status_records_for_json(recorded_state: ClusterState) -> None:
    rec = {r["id"]: r for r in status_records(recorded_state, include_gone=True)}
    a = rec[f"{WORKER_A:x}"]
    assert a["component"] == "backend" and a["role"] == "agg" and a["model"] == "tiny"
    assert a["node"] == "gpu-node-1" and a["pid"] > 0
    assert a["load"]["waiting"] == 7 and a["load"]["kv_usage"] == pytest.approx(0.93)
    assert rec[f"{WORKER_B:x}"]["loras"] == ["sql-lora"]
    assert rec[f"{PREFILL_2:x}"]["status"] == "gone"
    assert f"{PREFILL_2:x}" not in {r["id"] for r in status_records(recorded_state)}
    json.dumps(list(rec.values()))  # JSON-serialisable as dynamoctl prints it


# -- transitions ------------------------------------------------------------------------------------


def test_gone_worker_is_kept_then_pruned() -> None:
    state, clock = make_state()
    key = register(state, 0xA)
    state.apply_load(LoadMetrics(worker_id=0xA, num_running=3))
    state.delete_instance(key)
    w = state.find_worker(0xA)
    assert w.status == STATUS_GONE
    assert not w.stats.loads  # a gone worker's last load is not shown as current
    assert state.recent_events(kinds=["expired"])[0].severity == "warning"
    clock.advance(GONE_RETENTION_S + 1)
    state.tick()
    assert state.find_worker(0xA) is None and key not in state.instances


def test_drained_worker_leaving_is_not_a_warning() -> None:
    state, _ = make_state()
    key = register(state, 0xA)
    state.put_instance(key, make_instance(0xA, status="draining"))
    state.delete_instance(key)
    ev = state.recent_events(kinds=["expired"])[0]
    assert ev.severity == "info" and "after draining" in ev.message


def test_reregistration_after_gone_is_a_new_registration() -> None:
    state, _ = make_state()
    key = register(state, 0xA)
    state.delete_instance(key)
    state.put_instance(key, make_instance(0xA))
    assert state.find_worker(0xA).status == "ready"
    assert [e.kind for e in state.recent_events()] == ["registered", "expired", "registered"]


def test_sleep_and_wake_events() -> None:
    state, _ = make_state()
    keys = [instance_key("ns", "backend", ep, 0xA) for ep in ("generate", "sleep")]
    for k, ep in zip(keys, ("generate", "sleep"), strict=True):
        state.put_instance(k, make_instance(0xA, ep))
    for k, ep in zip(keys, ("generate", "sleep"), strict=True):
        state.put_instance(k, make_instance(0xA, ep, status="sleeping"))
    for k, ep in zip(keys, ("generate", "sleep"), strict=True):
        state.put_instance(k, make_instance(0xA, ep, status="ready"))
    assert [e.kind for e in state.recent_events()] == ["wake", "sleep", "registered"]


def test_identical_put_changes_nothing() -> None:
    state, _ = make_state()
    key = register(state, 0xA)
    before = (state.versions.topology, len(state.events))
    state.put_instance(key, make_instance(0xA))
    assert (state.versions.topology, len(state.events)) == before


def test_load_before_registration_attaches_later() -> None:
    state, _ = make_state()
    state.apply_load(LoadMetrics(worker_id=0xB, num_running=4, kv_usage=0.5))
    register(state, 0xB)
    assert state.find_worker(0xB).stats.running == 4


def test_orphan_load_is_dropped() -> None:
    state, clock = make_state()
    state.apply_load(LoadMetrics(worker_id=0xC))
    clock.advance(40)
    state.tick()
    assert 0xC not in state.stats


def test_lora_cards_become_models_and_events() -> None:
    state, _ = make_state()
    register(state, 0xA)
    state.put_card(mdc_key("ns", "backend", "generate", 0xA), ModelCard(served_model_name="m"))
    lkey = mdc_key("ns", "backend", "generate", 0xA, "ad1")
    state.put_card(lkey, ModelCard(served_model_name="ad1", lora="ad1", base_model="m"))
    assert set(state.models()) == {"m", "ad1"}
    assert state.find_worker(0xA).loras == {"ad1": "m"}
    state.delete_card(lkey)
    assert set(state.models()) == {"m"}
    assert [e.message for e in state.recent_events(kinds=["lora"])] == [
        "LoRA ad1 unloaded from 000000000000000a",
        "LoRA ad1 loaded on 000000000000000a (base m)",
    ]


def test_reconcile_marks_vanished_instances_gone() -> None:
    state, _ = make_state()
    k1 = register(state, 0x1)
    register(state, 0x2)
    state.reconcile_instances({k1: make_instance(0x1)})
    assert state.find_worker(0x1).status == "ready"
    assert state.find_worker(0x2).status == STATUS_GONE


def test_kv_events_count_blocks_clears_and_gaps() -> None:
    state, _ = make_state()
    register(state, 0xA)
    blocks = [StoredBlock(i, i) for i in range(5)]
    state.apply_kv_event(RouterEvent(worker_id=0xA, event_id=1, event=KvStored(parent_hash=None, blocks=blocks)))
    state.apply_kv_event(RouterEvent(worker_id=0xA, event_id=4, event=KvStored(parent_hash=None, blocks=blocks)))
    st = state.find_worker(0xA).stats
    assert st.cached_blocks == 10 and st.kv_gaps == 1
    state.apply_kv_event(RouterEvent(worker_id=0xA, event_id=5, event=KvCleared()))
    assert st.cached_blocks == 0
    assert state.recent_events(kinds=["kv"])[0].message == "KV cache cleared on 000000000000000a (10 blocks)"


def test_connection_loss_and_recovery_are_events() -> None:
    state, _ = make_state()
    state.set_connection("discovery", "ok", target="http://127.0.0.1:2379")
    state.set_connection("discovery", "ok")
    state.set_connection("discovery", "lost", detail="connection refused")
    state.set_connection("discovery", "lost", detail="connection refused")
    state.set_connection("discovery", "ok")
    msgs = [(e.severity, e.message) for e in state.recent_events(kinds=["connection"])]
    assert msgs == [
        ("info", "discovery connection recovered (http://127.0.0.1:2379)"),
        ("error", "discovery connection lost (http://127.0.0.1:2379): connection refused"),
        ("info", "discovery connected (http://127.0.0.1:2379)"),
    ]


def test_router_decision_that_is_not_a_routing_decision_is_a_decode_error() -> None:
    """Decisions are decoded with the wire type: a map missing its fields is reported, not guessed,
    whether it arrives live (msgpack or JSON) or from a recording."""
    for payload in (msgspec.msgpack.encode({"worker_id": "1f", "candidates": [{"worker_id": "1f", "cost": 3}]}),
                    msgspec.msgpack.encode({"nothing": 1}), b'{"worker_id": 5}', b"\xc1"):
        with pytest.raises(msgspec.DecodeError):
            decode_router_decision(payload)
    state, _ = make_state()
    for value in ({"worker_id": "1f", "candidates": [{"worker_id": "1f", "cost": 3}]}, {"nothing": 1}):
        apply_record(state, {"t": 0, "kind": "router_decision", "namespace": "ns", "value": value})
    assert state.counters["decode_errors"] == 2 and not state.decisions
    errors = state.recent_events(kinds=["error"])
    assert len(errors) == 1 and "unreadable router_decisions message" in errors[0].message


def test_decode_errors_are_shown_once_a_minute() -> None:
    state, clock = make_state()
    for _ in range(5):
        state.note_decode_error("kv_metrics", "bad")
    clock.advance(61)
    state.note_decode_error("kv_metrics", "bad")
    assert state.counters["decode_errors"] == 6
    assert len(state.recent_events(kinds=["error"])) == 2


def test_bad_metrics_text_is_an_error_not_a_crash() -> None:
    state, _ = make_state()
    state.apply_metrics_text("http://x/metrics", "this is { not prometheus")
    assert state.recent_events(kinds=["error"])
    assert state.metric_sources == []


# -- recording round trip -------------------------------------------------------------------------


def test_recording_sink_round_trip(recording: list[dict]) -> None:
    """What a RecordingSink writes replays to the same picture."""
    clock = ManualClock()
    original = ClusterState(clock=clock)
    buf = io.StringIO()
    sink = RecordingSink(original, buf.write)
    for rec in recording[:400]:
        clock.now = max(clock.now, rec["t"])
        # Drive the sink through its typed methods by replaying into a state whose calls it records.
        apply_record(sink, rec)  # type: ignore[arg-type]
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    again = replay(lines)
    assert status_records(again, include_gone=True) == status_records(original, include_gone=True)
    assert [e.message for e in again.recent_events()] == [e.message for e in original.recent_events()]


def test_replay_until_freezes_the_clock(recording: list[dict]) -> None:
    state = replay(recording, until=T0 + 35)
    assert state.clock() == T0 + 35
    assert state.find_worker(WORKER_C).status == "draining"
    assert state.find_worker(WORKER_D).status == "ready"  # it falls asleep later
    assert state.find_worker(PREFILL_2).status == "ready"


def test_read_records_skips_comments(tmp_path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text('# comment\n\n{"t": 1, "kind": "tick"}\n')
    assert read_records(p) == [{"t": 1, "kind": "tick"}]


def test_unknown_record_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown record kind"):
        replay([{"t": 0, "kind": "bogus"}])


def test_router_decision_from_the_routers_own_format() -> None:
    """A RoutingDecision's fields as published: reason and busy workers are explained too."""
    state, _ = make_state()
    wire = {
        "request_id": "r1", "worker_id": 5, "dp_rank": 0, "overlap_blocks": 2, "request_blocks": 4, "isl": 300,
        "reason": "tie_smallest_tree", "detail": "tie at cost 6.0", "overlap_weight": 1.0, "temperature": 0.0,
        "candidates": [
            {"worker_id": 5, "dp_rank": 0, "overlap_blocks": 2, "prefill_tokens": 40, "prefill_blocks": 2.5, "decode_blocks": 3, "cost": 5.5, "tree_size": 10},
            {"worker_id": 6, "dp_rank": 0, "overlap_blocks": 2, "prefill_tokens": 40, "prefill_blocks": 2.5, "decode_blocks": 3, "cost": 5.5, "tree_size": 90},
        ],
        "busy": [[7, 0, "queue full"]],
    }
    for payload in (msgspec.msgpack.encode(wire), msgspec.json.encode(wire)):  # the publisher's msgpack, or JSON
        d = state.apply_router_decision("ns", decode_router_decision(payload))
        assert d.request_id == "r1" and d.request_blocks == 4 and d.namespace == "ns" and d.ts == state.clock()
        assert d.candidates[0].tree_size == 10 and d.stage == "agg" and d.disagg is None
        assert d.why() == "tie, smallest cache: cost 5.50 = prefill 2.50 + decode 3 (overlap 2); next 0000000000000006 cost 5.50; 1 busy skipped"
