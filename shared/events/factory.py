"""Chooses the event plane by name (``DYN_EVENT_PLANE`` / ``--event-plane``).

``nats`` goes with etcd across nodes (a NATS server is the meeting point); ``zmq`` needs no server
and finds publishers through discovery (the ``file``/``mem`` backends of ``dynamod up``, or etcd).
Each implementation is imported only when chosen.
"""

from __future__ import annotations

import logging

from dynamod.shared.discovery.store import DiscoveryStore, Lease
from dynamod.shared.errors import ConfigError
from dynamod.shared.events.plane import EventPlane
from dynamod.shared.security.settings import NatsSecurity, RequestPlaneSecurity

logger = logging.getLogger(__name__)

EVENT_PLANE_NAMES = ("nats", "zmq")


def make_event_plane(
    name: str,
    *,
    nats_url: str | None = None,
    store: DiscoveryStore | None = None,
    lease: Lease | None = None,
    host: str = "127.0.0.1",
    advertise_host: str | None = None,
    nats_security: NatsSecurity | None = None,
    membership: RequestPlaneSecurity | None = None,
) -> EventPlane:
    """Builds (does not start) the event plane called ``name``.

    ``nats`` needs ``nats_url`` (and logs in with ``nats_security``); ``zmq`` needs the process's
    discovery ``store`` and ``lease`` (its publishers are registered under that lease) and binds its
    PUB sockets on ``host``, advertising ``advertise_host`` (default: ``host``, or this node's
    primary address for a wildcard). With a cluster token in ``membership`` (the request plane's
    settings: one notion of who is a member) its sockets speak CURVE and admit only members.
    """
    if name == "nats":
        if not nats_url:
            raise ConfigError("event plane 'nats' needs a NATS URL: pass --nats-server or set NATS_SERVER")
        from dynamod.shared.events.nats_plane import NatsEventPlane

        return NatsEventPlane(nats_url, security=nats_security)
    if name == "zmq":
        missing = [
            what for what, value in (("a discovery store", store), ("a lease", lease)) if value is None
        ]
        if missing:
            raise ConfigError(
                f"event plane 'zmq' needs {' and '.join(missing)}: its publishers are found through discovery"
            )
        assert store is not None and lease is not None
        from dynamod.shared.events.zmq_plane import ZmqEventPlane
        from dynamod.shared.security.curve import event_plane_curve

        token = membership.token if membership is not None else None
        if token is None and membership is not None and membership.tls_enabled:
            logger.warning(
                "event plane zmq is not authenticated: CURVE keys derive from the cluster token and none "
                "is set hint=set --cluster-token-file (or DYN_CLUSTER_TOKEN), or use --event-plane nats with TLS"
            )
        return ZmqEventPlane(store, lease, host=host, advertise_host=advertise_host, curve=event_plane_curve(token))
    raise ConfigError(
        f"unknown event plane {name!r}; choose one of {', '.join(EVENT_PLANE_NAMES)} (--event-plane / DYN_EVENT_PLANE)"
    )
