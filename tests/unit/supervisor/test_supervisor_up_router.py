"""``dynamod up`` picks the frontend's router: the KV router when a planner adds and removes workers
(a worker that just joined is the cheapest candidate, so it takes new requests at once instead of
the first worker's backlog getting a third of them, as round-robin does; measured in
``tests/integration/planner/test_up_planner.py``), round-robin for a fixed fleet, and ``--router-mode``
always wins."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.supervisor.up import add_args, build_specs, resolve_scaling


def _frontend_router(*argv: str) -> str:
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(list(argv))
    resolve_scaling(args)
    frontend = next(s for s in build_specs(args, "/tmp/kv", "ns") if s.name == "frontend").argv
    return frontend[frontend.index("--router-mode") + 1]


@pytest.mark.parametrize(("argv", "mode"), [
    ((), "round-robin"),
    (("--workers", "3"), "round-robin"),
    (("--planner", "load"), "kv"),
    (("--planner", "sla", "--prefill-workers", "1", "--decode-workers", "1", "--planner-args",
      "--profile /nonexistent"), "kv"),
    (("--accept-scaling",), "kv"),
    (("--planner", "load", "--router-mode", "round-robin"), "round-robin"),
    (("--router-mode", "random"), "random"),
])
def test_router_mode(argv: tuple[str, ...], mode: str) -> None:
    assert _frontend_router(*argv) == mode


def _planner_argv(*argv: str) -> list[str]:
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(list(argv))
    resolve_scaling(args)
    return next(s for s in build_specs(args, "/tmp/kv", "ns") if s.name == "planner").argv


def test_a_planner_over_mocker_workers_is_told_they_start_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scale-down hysteresis is a multiple of a worker's start-up: on the GPU default (30 s) an
    idle `dynamod up` of mocker workers took three minutes to shrink."""
    monkeypatch.delenv("DYN_PLANNER_WORKER_STARTUP_TIME", raising=False)
    argv = _planner_argv("--planner", "load")
    assert argv[argv.index("--worker-startup-time") + 1] == "5"
    named = _planner_argv("--planner", "load", "--planner-args", "--worker-startup-time 40")
    assert named.count("--worker-startup-time") == 1 and named[named.index("--worker-startup-time") + 1] == "40"
    monkeypatch.setenv("DYN_PLANNER_WORKER_STARTUP_TIME", "12")
    assert "--worker-startup-time" not in _planner_argv("--planner", "load")
