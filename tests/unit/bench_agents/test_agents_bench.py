"""``bench/agents.py``: its seeded workload, and one ``--quick`` run end to end on real processes
whose JSON must have every figure and no failed request. The run takes two of the configurations
(a small cluster each, about 6 s on an idle machine): round-robin without sessions, and KV routing
with sessions and pinning, which between them send every kind of request the other two do."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load_bench() -> ModuleType:
    """bench/agents.py under a name of its own, with sys.path restored after: imported as
    ``agents`` (or with bench/ left on sys.path) it would shadow the openai-agents package
    (``import agents``) for every later test in this process."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("dynamod_bench_agents", BENCH / "agents.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


agents = _load_bench()

FIGURES = {
    "requests", "failed", "prefix_hit_rate", "prefix_hit_rate_frontend_metrics", "prompt_tokens",
    "cache_read_input_tokens", "cache_creation_input_tokens", "ttft_ms_p50", "ttft_ms_p99", "wall_s",
    "fleet_worker_s", "busy_worker_s", "workers_per_session_mean", "router_sessions",
}


def test_workload_is_seeded_and_fits_its_context() -> None:
    args = agents.parse_args(["--sessions", "6", "--min-turns", "5", "--max-turns", "20", "--max-context", "5000"])
    first, again = agents.make_workload(args), agents.make_workload(args)
    assert first == again
    assert agents.make_workload(agents.parse_args(["--sessions", "6", "--seed", "1"])) != first
    for plan in first.sessions:
        assert 1 <= len(plan.turns) <= 20
        assert plan.context_tokens_est + plan.turns[-1].max_tokens <= 5000
        assert all(t.tool_name and t.tool_output for t in plan.turns[:-1])  # a tool runs between turns
        assert not plan.turns[-1].tool_name  # the last turn is the final answer
        assert all(0.2 <= t.think_s <= 2.0 for t in plan.turns[1:])


def test_pinned_requests_mark_the_last_tool_and_system_block() -> None:
    plan = agents.make_workload(agents.parse_args(["--sessions", "1", "--quick"])).sessions[0]
    plain = agents.request_body(plan, [], plan.turns[0], pin=False)
    pinned = agents.request_body(plan, [], plan.turns[0], pin=True)
    assert "cache_control" not in json.dumps(plain)
    assert pinned["tools"][-1]["cache_control"] == pinned["system"][-1]["cache_control"] == agents.PIN
    assert json.dumps(pinned).count("cache_control") == 2
    assert "cache_control" not in json.dumps(plan.tools)  # the plan itself is not marked


def test_busy_seconds_is_the_union_of_intervals() -> None:
    assert agents.busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
    assert agents.busy_seconds([]) == 0.0


def test_session_ceiling_counts_the_previous_prompt_in_whole_blocks() -> None:
    def done(session: int, turn: int, read: int, fresh: int) -> agents.Outcome:
        return agents.Outcome(session, turn, ok=True, usage={"input_tokens": fresh, "cache_read_input_tokens": read})

    # Session 0: 100 then 200 tokens (96 of the first in whole blocks); session 1: one turn of 50.
    ok = [done(0, 1, 64, 136), done(1, 0, 0, 50), done(0, 0, 0, 100)]
    assert agents.session_ceiling(ok, 16) == pytest.approx(96 / 350, abs=1e-4)


def test_bad_configuration_name_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "agents.py"), "--configs", "kv,nope"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "unknown configuration(s) nope" in proc.stderr


RUN = ("round-robin", "kv+session+pin")


@pytest.mark.timeout(60)
def test_quick_run_end_to_end() -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "agents.py"), "--quick", "--configs", ",".join(RUN)],
                          capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["failed"] == 0
    requests = report["workload"]["requests"]
    sessions = report["workload"]["sessions"]
    assert list(report["configs"]) == list(RUN)
    for name, figures in report["configs"].items():
        assert FIGURES <= set(figures), name
        assert figures["failed"] == 0 and figures["requests"] == requests, name
        assert 0.0 <= figures["prefix_hit_rate"] <= 1.0
        assert figures["prefix_hit_rate"] == pytest.approx(figures["prefix_hit_rate_frontend_metrics"], abs=0.02)
        assert 0 < figures["ttft_ms_p50"] <= figures["ttft_ms_p99"]
        assert 0 < figures["busy_worker_s"] <= figures["fleet_worker_s"]
        outcomes = figures["router_sessions"]
        if agents.CONFIGS[name].session:  # every request named its session
            assert outcomes["new"] == sessions
            assert outcomes["new"] + outcomes["kept"] + outcomes["moved"] == requests
        else:
            assert sum(outcomes.values()) == 0
    pin = report["configs"]["kv+session+pin"]["pinning"]
    assert pin["requested"] is True and isinstance(pin["reported"], bool)
    assert pin["reported"] == (report["configs"]["kv+session+pin"]["cache_creation_input_tokens"] > 0)
