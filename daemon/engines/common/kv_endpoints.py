"""Where an engine's ZMQ KV event publisher and our subscriber meet, and who binds.

vLLM's (and SGLang's) ``ZmqEventPublisher`` *binds* only when the endpoint is a wildcard
(``tcp://*:port``, ``::``) or ``ipc://``/``inproc://``; any other endpoint, e.g.
``tcp://127.0.0.1:port``, it *connects* to. Its default ``tcp://*:5557`` would listen on every
interface, which a worker must not do, and a fixed port collides when several engines share a host.

So by default the subscriber binds a loopback port chosen by the OS (``tcp://127.0.0.1:*``; the
plan is ``resolve``d with the port bound) and the engine connects to it: no port to race for,
nothing listening beyond 127.0.0.1, and a connecting PUB queues from the moment it connects. With
data parallelism each rank's publisher adds its rank to the port, so the subscriber binds
``base + rank`` for every rank, from a run of ports found free. When the operator gives an endpoint of their own the rule is
applied the other way round: we connect to an endpoint the engine binds (a wildcard is reached at
127.0.0.1) and bind one it connects to.

The replay endpoint (a ROUTER the publisher always binds) lets the subscriber fetch batches it
missed; it lives in the worker's private directory as ``ipc://`` for one rank, or on loopback TCP
(``base + rank``) for several, since the publishers offset only TCP ports by rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dynamod.shared.transport.ports import free_port_run

DEFAULT_TOPIC = "kv-events"


@dataclass(frozen=True, slots=True)
class SubscriberEndpoint:
    address: str
    bind: bool  # True: we bind and the engine connects; False: we connect to the engine


@dataclass(frozen=True, slots=True)
class KvEventsPlan:
    """What to give the engine (``config``) and what the subscriber does (per DP rank)."""

    config: dict[str, object]
    subscribe: list[SubscriberEndpoint]
    replay: dict[int, str] = field(default_factory=dict)  # dp rank -> ROUTER endpoint to connect
    topic: str = DEFAULT_TOPIC

    def resolve(self, bound: list[str]) -> None:
        """Fills an OS-chosen port into the engine's endpoint once the subscriber has bound it."""
        endpoint = str(self.config.get("endpoint", ""))
        if endpoint.endswith(":*"):
            if not bound:
                raise ValueError("the subscriber bound nothing; cannot tell the engine where to connect")
            self.config["endpoint"] = bound[0]


def publisher_binds(endpoint: str) -> bool:
    """The vLLM/SGLang publisher's rule: bind wildcard and ipc/inproc endpoints, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint rank ``rank``'s publisher uses: TCP port + rank, ``inproc`` + ``_dp{rank}``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise ValueError(f"endpoint {endpoint!r} cannot be offset by data-parallel rank; use tcp:// with several ranks")


def reachable(endpoint: str) -> str:
    """An endpoint the engine binds, as this host connects to it (wildcards -> loopback)."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "::", "[::]"):
            return f"tcp://127.0.0.1:{port}"
    return endpoint


def plan_kv_events(
    user_config: dict[str, object] | None,
    *,
    data_parallel_size: int,
    private_dir: str,
    sub_base_port: int | None = None,
    replay_base_port: int | None = None,
) -> KvEventsPlan:
    """Decides the engine's ``kv_events_config`` and the subscriber's sockets.

    ``user_config``: the operator's own config (their ``--kv-events-config``), or None for ours.
    ``sub_base_port``/``replay_base_port``: loopback ports already chosen (tests); picked here
    otherwise.
    """
    ranks = range(max(1, data_parallel_size))
    if user_config is not None and user_config.get("enable_kv_cache_events") is False:
        raise ValueError("KV events are disabled in --kv-events-config; the KV router needs them")
    if user_config is not None and user_config.get("publisher", "zmq") not in ("zmq", None):
        raise ValueError(f"--kv-events-config publisher {user_config.get('publisher')!r} is not zmq")
    topic = str((user_config or {}).get("topic") or DEFAULT_TOPIC)
    config: dict[str, object] = dict(user_config or {})
    config.update(enable_kv_cache_events=True, publisher="zmq", topic=topic)
    if user_config is not None and user_config.get("endpoint"):
        endpoint = str(user_config["endpoint"])
        engine_binds = publisher_binds(endpoint)
        subscribe = [
            SubscriberEndpoint(
                reachable(offset_endpoint(endpoint, r)) if engine_binds else offset_endpoint(endpoint, r),
                bind=not engine_binds,
            )
            for r in ranks
        ]
    elif len(ranks) == 1 and sub_base_port is None:
        config["endpoint"] = "tcp://127.0.0.1:*"  # resolve() puts the bound port here
        subscribe = [SubscriberEndpoint("tcp://127.0.0.1:*", bind=True)]
    else:
        base = sub_base_port if sub_base_port is not None else free_port_run(len(ranks))
        config["endpoint"] = f"tcp://127.0.0.1:{base}"
        subscribe = [SubscriberEndpoint(f"tcp://127.0.0.1:{base + r}", bind=True) for r in ranks]
    replay_endpoint = config.get("replay_endpoint")
    if not replay_endpoint:
        if len(ranks) == 1:
            replay_endpoint = f"ipc://{os.path.join(private_dir, 'kv-replay.ipc')}"
        else:
            base = replay_base_port if replay_base_port is not None else free_port_run(len(ranks))
            replay_endpoint = f"tcp://127.0.0.1:{base}"
        config["replay_endpoint"] = replay_endpoint
    replay = {r: reachable(offset_endpoint(str(replay_endpoint), r)) for r in ranks}
    return KvEventsPlan(config=config, subscribe=subscribe, replay=replay, topic=topic)
