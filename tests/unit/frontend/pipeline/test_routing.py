"""Routing policies, the worker-id header, quarantine, and the frontend fleet's command line."""

from __future__ import annotations

import random

import pytest

from dynamod.daemon.frontend.http.port_sharing import child_argv
from dynamod.daemon.frontend.pipeline.routing import (
    Quarantine,
    RandomRouter,
    RoundRobinRouter,
    RouteRequest,
    header_candidates,
    make_basic_router,
    parse_instance_id,
)
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.protocol.instance import Instance


def _inst(iid: int) -> Instance:
    return Instance(namespace="dynamo", component="backend", endpoint="generate", instance_id=iid, transport="tcp", address="x:1")


async def test_round_robin_cycles_over_candidates() -> None:
    router = RoundRobinRouter()
    cands = [_inst(1), _inst(2), _inst(3)]
    picks = [(await router.select(RouteRequest(str(i), []), cands)).worker_id for i in range(6)]
    assert picks == [1, 2, 3, 1, 2, 3]


async def test_random_router_uses_every_candidate() -> None:
    router = RandomRouter(random.Random(1))
    cands = [_inst(1), _inst(2)]
    picks = {(await router.select(RouteRequest(str(i), []), cands)).worker_id for i in range(50)}
    assert picks == {1, 2}


def test_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        make_basic_router("fastest")


def test_worker_header_hex_and_decimal() -> None:
    assert parse_instance_id("1a2b") == 0x1A2B
    assert parse_instance_id("0x10") == 16
    assert parse_instance_id(" 42 ") == 42
    assert header_candidates("42") == [42, 0x42]
    assert header_candidates("ff") == [255]
    with pytest.raises(InvalidRequestError):
        parse_instance_id("zz")
    with pytest.raises(InvalidRequestError):
        parse_instance_id("")


def test_quarantine_expires() -> None:
    q = Quarantine(hold_s=10)
    q.add(7, hold_s=0.0)
    q.add(8)
    assert 7 not in q  # expired at once
    assert 8 in q
    q.discard(8)
    assert 8 not in q


def test_child_argv_fixes_port_and_fleet_size() -> None:
    argv = ["--role", "frontend", "--http-port", "0", "--num-frontends=4", "--router-mode", "random"]
    out = child_argv(argv, 8123, 99)
    assert out[:4] == ["--role", "frontend", "--router-mode", "random"]
    assert out[-6:] == ["--num-frontends", "1", "--http-port", "8123", "--frontend-group-pid", "99"]
