"""Factories for state-level console tests (vLLM's ``tests/v1/core/utils.py`` habit): a state on a
manual clock, and discovery records with only the fields a test cares about spelled out."""

from __future__ import annotations

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import ManualClock
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import instance_key

NAMESPACE = "ns"


def make_state(now: float = 1000.0) -> tuple[ClusterState, ManualClock]:
    clock = ManualClock(now)
    return ClusterState(clock=clock), clock


def make_instance(
    iid: int, endpoint: str = "generate", status: str = "ready", component: str = "backend", role: str = "agg"
) -> Instance:
    return Instance(namespace=NAMESPACE, component=component, endpoint=endpoint, instance_id=iid, transport="tcp",
                    address="127.0.0.1:1", role=role, status=status, model="m", started_at=100.0)


def register(state: ClusterState, iid: int, role: str = "agg", status: str = "ready", endpoint: str = "generate") -> str:
    """Puts one endpoint record of worker ``iid`` (prefill workers in their own component, as
    Dynamo deploys them) and returns its discovery key."""
    component = "prefill" if role == "prefill" else "backend"
    key = instance_key(NAMESPACE, component, endpoint, iid)
    state.put_instance(key, make_instance(iid, endpoint, status, component, role))
    return key
