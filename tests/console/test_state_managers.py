"""The managers behind ``ClusterState``, each on its own: the rules that live in one of them (action
targets, throttled decode errors, orphan and gone retention, imbalance repeats, scrape windows) with
exact-state asserts. What they do together is covered through the façade in test_cluster_state.py."""

from __future__ import annotations

import pytest

from dynamod.console.state.event_log import DECODE_ERROR_REPEAT_S, EventLog
from dynamod.console.state.frontends import LATENCY_WINDOW_S, FrontendScrapes
from dynamod.console.state.imbalance import IMBALANCE_REPEAT_S, ImbalanceWatch
from dynamod.console.state.load import ORPHAN_STATS_TTL_S, LoadTally
from dynamod.console.state.prom import FrontendScrape
from dynamod.console.state.recording import ManualClock
from dynamod.console.state.records import ClusterEvent, EndpointInstance, Worker, WorkerStats
from dynamod.console.state.scaling import describe_decision
from dynamod.console.state.topology import GONE_RETENTION_S, Topology
from dynamod.console.state.versions import Versions
from dynamod.shared.protocol.keys import instance_key
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.planner import PlannerDecision
from tests.console.factories import make_instance, make_state, register

# -- EventLog ---------------------------------------------------------------------------------------


def _log(now: float = 0.0) -> tuple[EventLog, ManualClock, Versions]:
    clock, versions = ManualClock(now), Versions()
    return EventLog(clock, versions, maxlen=3), clock, versions


def test_event_log_is_bounded_newest_first_and_tells_listeners() -> None:
    log, clock, versions = _log()
    heard: list[ClusterEvent] = []
    log.add_listener(heard.append)
    for i in range(4):
        clock.advance(1)
        log.add("kv", f"e{i}")
    assert [e.message for e in log.recent()] == ["e3", "e2", "e1"]  # the oldest fell off
    assert [e.message for e in heard] == ["e0", "e1", "e2", "e3"]
    assert [e.ts for e in log.recent(limit=2)] == [4.0, 3.0]
    assert versions.events == 4


@pytest.mark.parametrize(
    ("target", "instance_id"),
    [("1f", 0x1F), ("0x1F", 0x1F), ("dynamo/backend/abc", 0xABC), ("worker-1", None), ("", None)],
)
def test_action_event_names_the_instance_it_acted_on(target: str, instance_id: int | None) -> None:
    log, _, _ = _log()
    ev = log.record_action("drain", target, False, "refused")
    assert (ev.kind, ev.severity, ev.instance_id) == ("action", "error", instance_id)
    assert ev.message == f"drain {target}: failed: refused"


def test_decode_errors_are_counted_always_and_shown_once_per_source_per_window() -> None:
    log, clock, _ = _log()
    log.note_decode_error("kv_metrics", "bad")
    log.note_decode_error("kv_events", "bad")  # another source is shown at once
    clock.advance(DECODE_ERROR_REPEAT_S - 1)
    log.note_decode_error("kv_metrics", "bad")
    clock.advance(1)
    log.note_decode_error("kv_metrics", "worse")
    assert log.decode_errors == 4
    assert [e.message for e in log.recent(kinds=["error"])] == [
        "unreadable kv_metrics message: worse",
        "unreadable kv_events message: bad",
        "unreadable kv_metrics message: bad",
    ]


# -- LoadTally --------------------------------------------------------------------------------------


def _kv(event_id: int, event: object) -> RouterEvent:
    return RouterEvent(worker_id=7, event_id=event_id, event=event)  # type: ignore[arg-type]


def test_kv_events_report_only_what_a_clear_dropped() -> None:
    versions = Versions()
    load = LoadTally(versions)
    blocks = [StoredBlock(i, i) for i in range(4)]
    assert load.apply_kv_event(_kv(1, KvStored(parent_hash=None, blocks=blocks))) is None
    assert load.apply_kv_event(_kv(2, KvRemoved(block_hashes=[0]))) is None
    assert load.apply_kv_event(_kv(3, KvCleared())) == 3
    assert load.apply_kv_event(_kv(4, KvCleared())) == 0
    st = load.stats[7]
    assert (st.cached_blocks, st.kv_events, st.kv_gaps, load.kv_events, versions.load) == (0, 4, 0, 4, 4)


def test_latencies_bump_the_load_version_only_when_there_are_some() -> None:
    versions = Versions()
    load = LoadTally(versions)
    load.apply_latencies({}, {})
    assert versions.load == 0 and not load.stats
    load.apply_latencies({1: 0.2}, {2: 0.01})
    assert (load.stats[1].ttft_s, load.stats[2].itl_s, versions.load) == (0.2, 0.01, 1)


def test_prune_drops_only_unclaimed_stale_tallies_and_their_transfers() -> None:
    load = LoadTally(Versions())
    for wid in (1, 2, 3):
        load.apply_load(LoadMetrics(worker_id=wid, ts=1.0, kv_transfers=1), now=100.0)
    load.apply_load(LoadMetrics(worker_id=3, ts=2.0, kv_transfers=1), now=100.0 + ORPHAN_STATS_TTL_S)
    load.prune(100.0 + ORPHAN_STATS_TTL_S + 1, live_ids={1})
    assert set(load.stats) == {1, 3}  # 1 is claimed by a worker, 3 was fed recently
    assert load.transfers.figures(2) is None and load.transfers.figures(3) is not None


def test_a_gone_worker_keeps_its_history_but_not_its_load() -> None:
    load = LoadTally(Versions())
    load.apply_load(LoadMetrics(worker_id=5, num_running=2, kv_transfers=1), now=1.0)
    load.sample_history()
    worker = Worker("ns", "backend", 5, stats=load.stats_for(5))
    load.worker_gone(worker)
    assert not load.stats[5].loads and list(load.stats[5].history) == [2.0]
    assert load.transfers.figures(5) is None
    assert load.stats_for(5) is worker.stats  # the tally stays attached for a re-registration


# -- Topology ---------------------------------------------------------------------------------------


def _topology() -> tuple[Topology, ManualClock, Versions]:
    clock, versions = ManualClock(1000.0), Versions()
    load = LoadTally(versions)
    return Topology(clock, versions, EventLog(clock, versions), load), clock, versions


def test_gone_records_are_kept_for_the_retention_then_pruned() -> None:
    topo, clock, versions = _topology()
    key = instance_key("ns", "backend", "generate", 0xA)
    topo.put_instance(key, make_instance(0xA))
    topo.delete_instance(key)
    clock.advance(GONE_RETENTION_S)
    before = versions.topology
    topo.prune(clock())
    assert topo.find_worker(0xA) is not None and versions.topology == before  # not yet: nothing changed
    clock.advance(1)
    topo.prune(clock())
    assert (topo.workers, topo.instances, topo.live_ids(), versions.topology) == ({}, {}, set(), before + 1)


def test_find_worker_prefers_the_live_one_and_first_worker_does_not() -> None:
    topo, _, _ = _topology()
    gone_key = instance_key("ns", "old", "generate", 0xA)
    topo.put_instance(gone_key, make_instance(0xA, component="old"))
    topo.delete_instance(gone_key)
    topo.put_instance(instance_key("ns", "backend", "generate", 0xA), make_instance(0xA))
    assert topo.find_worker(0xA).component == "backend"
    assert topo.first_worker(0xA).component == "old"  # discovery order, gone or not
    assert [w.component for w in topo.worker_list(include_gone=False)] == ["backend"]


# -- FrontendScrapes --------------------------------------------------------------------------------


def test_scrape_ring_keeps_the_window_and_forgetting_is_a_change_once() -> None:
    versions = Versions()
    scrapes = FrontendScrapes(versions)
    for t in (0.0, 10.0, 20.0, 20.0 + LATENCY_WINDOW_S + 5):
        scrapes.add("http://f/metrics", FrontendScrape(requests={"m": t}), now=t)
    # The newest scrape and the oldest still inside the window remain (rate over >= the window).
    stats = scrapes.model_stats()["m"]
    assert stats.requests_total == 20.0 + LATENCY_WINDOW_S + 5
    assert stats.request_rate == pytest.approx(1.0)
    scrapes.forget("http://f/metrics")
    scrapes.forget("http://f/metrics")
    assert scrapes.sources == [] and versions.models == 5


# -- ImbalanceWatch ---------------------------------------------------------------------------------


def _peers(hot_kv: float) -> list[Worker]:
    out = []
    for iid, kv in ((1, hot_kv), (2, 0.1), (3, 0.1)):
        w = Worker("ns", "backend", iid, stats=WorkerStats(loads={0: LoadMetrics(worker_id=iid, kv_usage=kv)}))
        key = instance_key("ns", "backend", "generate", iid)
        w.endpoints["generate"] = EndpointInstance(key, make_instance(iid))
        out.append(w)
    return out


def test_a_flapping_worker_is_reported_once_per_repeat_window() -> None:
    clock, versions = ManualClock(), Versions()
    log = EventLog(clock, versions)
    watch = ImbalanceWatch(log)
    for hot, t in ((0.9, 0.0), (0.9, 1.0), (0.1, 2.0), (0.9, 3.0), (0.1, 4.0), (0.9, IMBALANCE_REPEAT_S + 1)):
        watch.update(_peers(hot), now=t)
    assert [(i.kind, i.instance_id) for i in watch.current] == [("hot", 1)]
    assert len(log.recent(kinds=["imbalance"])) == 2  # at 0 and after the repeat window, not at 3


# -- the façade's own wiring -----------------------------------------------------------------------


def test_counters_are_read_from_the_managers() -> None:
    state, _ = make_state()
    register(state, 1)
    state.apply_load(LoadMetrics(worker_id=1))
    state.apply_kv_event(RouterEvent(worker_id=1, event_id=1, event=KvCleared()))
    state.note_decode_error("x", "bad")
    assert state.counters == {"load_updates": 1, "kv_events": 1, "decode_errors": 1}


def test_planner_decision_line() -> None:
    d = PlannerDecision(decision_id=3, ts=1.0, namespace="ns", planner="load", pool="prefill", component="prefill",
                        current=2, desired=3, action="scale_up", reason="queue_high", detail="12 waiting > 10")
    assert describe_decision(d) == "planner load ns/prefill: scale up 2 -> 3 (queue_high: 12 waiting > 10)"
    failed = PlannerDecision(decision_id=4, ts=1.0, namespace="ns", planner="sla", pool="decode", component="backend",
                             current=2, desired=2, action="hold", reason="grace_period", dry_run=True, error="k8s 403")
    assert describe_decision(failed) == "planner sla ns/decode: hold stays 2 (grace_period) [dry run] failed: k8s 403"
