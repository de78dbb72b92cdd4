"""Chooses the planner's connector by name (``--connector``) and builds it from its flags.

Each connector's module is imported only when it is chosen, so a planner that drives a ``dynamod
up`` supervisor does not import lightkube, and one that scales Kubernetes does not import asyncssh.
Flags follow the house rule: CLI first, then a ``DYN_*`` variable, then the default printed by
``--help``. The flags of every connector are always registered (``--help`` shows them all); a
connector ignores the others'.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dynamod.daemon.planner.connectors.k8s_namespace import SA_NAMESPACE_FILE
from dynamod.shared.config import env_or
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.planner import POOLS

if TYPE_CHECKING:
    from dynamod.daemon.planner.connectors.base import Connector
    from dynamod.shared.runtime.distributed import DistributedRuntime

CONNECTORS = ("local", "ssh", "virtual", "kubernetes")
DEFAULT_CONNECTOR = "virtual"
# An orchestrator that has not acknowledged a decision after this long is reported (Dynamo's
# virtual connector waits up to 30 minutes; a local process starts in seconds, a pod in minutes).
DEFAULT_ACK_TIMEOUT_S = 600.0
DEFAULT_SUPERVISOR_WAIT_S = 30.0
DEFAULT_DRAIN_TIMEOUT_S = 120.0
DEFAULT_DEPLOYMENTS = {pool: f"dynamod-{pool}" for pool in POOLS}
K8S_KINDS = ("deployment", "statefulset")


def _float(name: str, default: float) -> float:
    text = env_or(name, str(default))
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds") from None


def add_connector_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """Registers ``--connector`` and every connector's flags on ``group``."""
    g = group
    g.add_argument(
        "--connector", choices=CONNECTORS, default=env_or("DYN_PLANNER_CONNECTOR", DEFAULT_CONNECTOR),
        help="who carries decisions out: local (the `dynamod up` supervisor), ssh (hosts of a `dynamoctl cluster` "
             "inventory), virtual (desired counts in discovery for an external orchestrator), kubernetes "
             f"(Deployments' scale subresource) [env DYN_PLANNER_CONNECTOR, default {DEFAULT_CONNECTOR}]",
    )
    g.add_argument(
        "--scale-ack-timeout", type=float, default=_float("DYN_SCALE_ACK_TIMEOUT", DEFAULT_ACK_TIMEOUT_S),
        metavar="S",
        help="local/virtual: seconds after which a decision the orchestrator has not acknowledged (ScaledReplicas) "
             f"is logged as unacknowledged [env DYN_SCALE_ACK_TIMEOUT, default {DEFAULT_ACK_TIMEOUT_S:g}]",
    )
    g.add_argument(
        "--supervisor-wait", type=float, default=_float("DYN_SUPERVISOR_WAIT", DEFAULT_SUPERVISOR_WAIT_S),
        metavar="S",
        help="local: seconds to wait at start for a `dynamod up` supervisor that accepts scaling on this namespace "
             f"[env DYN_SUPERVISOR_WAIT, default {DEFAULT_SUPERVISOR_WAIT_S:g}]",
    )
    g.add_argument(
        "--inventory", default=env_or("DYN_INVENTORY", ""), metavar="PATH",
        help="ssh: the `dynamoctl cluster` inventory (TOML); its worker roles are the slots the planner starts "
             "and stops, in inventory order [env DYN_INVENTORY, required with --connector ssh]",
    )
    g.add_argument(
        "--drain-timeout", type=float, default=_float("DYN_DRAIN_TIMEOUT", DEFAULT_DRAIN_TIMEOUT_S), metavar="S",
        help="ssh: seconds a removed worker gets to finish its in-flight requests before it is stopped "
             f"[env DYN_DRAIN_TIMEOUT, default {DEFAULT_DRAIN_TIMEOUT_S:g}]",
    )
    g.add_argument(
        "--k8s-namespace", default=env_or("DYN_K8S_NAMESPACE", ""), metavar="NS",
        help="kubernetes: namespace of the Deployments [env DYN_K8S_NAMESPACE, default the pod's own, from "
             f"{SA_NAMESPACE_FILE}, else the kubeconfig's]",
    )
    g.add_argument(
        "--k8s-deployment", action="append", default=None, metavar="POOL=NAME",
        help="kubernetes: the workload scaled for a pool, repeatable [env DYN_K8S_DEPLOYMENTS as "
             "'prefill=a,decode=b'; default " + ", ".join(f"{p}={n}" for p, n in DEFAULT_DEPLOYMENTS.items()) + "]",
    )
    g.add_argument(
        "--k8s-kind", choices=K8S_KINDS, default=env_or("DYN_K8S_KIND", "deployment"),
        help="kubernetes: kind of the pools' workloads [env DYN_K8S_KIND, default deployment]",
    )
    g.add_argument(
        "--kubeconfig", default=env_or("KUBECONFIG", ""), metavar="PATH",
        help="kubernetes: kubeconfig to use outside a cluster [env KUBECONFIG, default in-cluster service account, "
             "else ~/.kube/config]",
    )


def parse_deployments(items: list[str] | None) -> dict[str, str]:
    """``["decode=my-decode"]`` (or ``DYN_K8S_DEPLOYMENTS``) over the defaults: pool -> workload name."""
    out = dict(DEFAULT_DEPLOYMENTS)
    if items is None:
        env = env_or("DYN_K8S_DEPLOYMENTS", "")
        items = [part for part in env.split(",") if part.strip()]
    for item in items:
        pool, sep, name = item.partition("=")
        pool, name = pool.strip(), name.strip()
        if not sep or pool not in POOLS or not name:
            raise ConfigError(f"--k8s-deployment {item!r}: expected POOL=NAME with POOL one of {', '.join(POOLS)}")
        out[pool] = name
    return out


async def create_connector(args: argparse.Namespace, runtime: DistributedRuntime) -> Connector:
    """The connector ``args.connector`` names, built but not started (the caller awaits ``start``)."""
    name = getattr(args, "connector", DEFAULT_CONNECTOR)
    namespace = runtime.settings.namespace
    if name == "virtual":
        from dynamod.daemon.planner.connectors.virtual import VirtualConnector

        return VirtualConnector(runtime.store, namespace, ack_timeout_s=args.scale_ack_timeout)
    if name == "local":
        from dynamod.daemon.planner.connectors.local import LocalConnector

        return LocalConnector(
            runtime.store, namespace, ack_timeout_s=args.scale_ack_timeout, supervisor_wait_s=args.supervisor_wait
        )
    if name == "ssh":
        from dynamod.daemon.planner.connectors.ssh import SshConnector

        if not args.inventory:
            raise ConfigError("--connector ssh needs --inventory PATH (a `dynamoctl cluster` inventory)")
        return SshConnector(runtime, namespace, args.inventory, drain_timeout_s=args.drain_timeout)
    if name == "kubernetes":
        from dynamod.daemon.planner.connectors.kubernetes import KubernetesConnector

        return KubernetesConnector(
            deployments=parse_deployments(args.k8s_deployment),
            namespace=args.k8s_namespace or None,
            kind=args.k8s_kind,
            kubeconfig=args.kubeconfig or None,
        )
    raise ConfigError(f"unknown connector {name!r}; choose one of {', '.join(CONNECTORS)}")
