"""The Kubernetes connector: each pool is a Deployment (or StatefulSet), scaled through the apps/v1
``scale`` subresource.

``set_replicas`` reads ``.../deployments/NAME/scale`` and, when ``spec.replicas`` differs, sends a
merge patch of ``spec.replicas`` to it: the subresource is what ``kubectl scale`` and the HPA use,
and it is all the planner's RBAC grants (``deploy/kubernetes/base/planner.yaml``: get deployments,
get/patch/update ``deployments/scale`` of the three pools). Ready counts are the workload's
``status.readyReplicas``: pods whose readiness probe (``/health``) passes, so a new pod counts
once its worker serves. Scale-down is lossless on the pod side: the removed pod gets SIGTERM, and
the worker deregisters and finishes its in-flight requests (its ``--shutdown-grace``, within the
pod's ``terminationGracePeriodSeconds``) before it exits.

The workloads default to ``dynamod-prefill``, ``dynamod-decode`` and ``dynamod-agg`` (the names of
``deploy/kubernetes``); a pool whose workload does not exist (an agg deployment has no prefill
pool) is not managed, and asking to scale it is an error. lightkube is imported only here, so only
a planner that drives Kubernetes needs the ``planner`` extra.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.types import PatchType

from dynamod.daemon.planner.connectors.k8s_namespace import SA_NAMESPACE_FILE, k8s_namespace

try:  # lightkube 1.x talks through httpx2, 0.x through httpx: catch the transport errors of the one it uses
    import httpx2 as _http
except ImportError:  # pragma: no cover - depends on the installed lightkube
    import httpx as _http  # type: ignore[no-redef]
from dynamod.shared.errors import ConfigError, DynamoError, UnavailableError

logger = logging.getLogger(__name__)

FIELD_MANAGER = "dynamod-planner"
_KINDS: dict[str, Any] = {"deployment": Deployment, "statefulset": StatefulSet}


class KubernetesConnector:
    """Scales the pools' workloads through the Kubernetes API."""

    name = "kubernetes"

    def __init__(
        self,
        *,
        deployments: dict[str, str],
        namespace: str | None = None,
        kind: str = "deployment",
        kubeconfig: str | None = None,
        sa_namespace_file: str = SA_NAMESPACE_FILE,
        client: AsyncClient | None = None,
    ) -> None:
        if kind not in _KINDS:
            raise ConfigError(f"unknown workload kind {kind!r}; choose deployment or statefulset")
        self.deployments = dict(deployments)
        self.namespace = namespace
        self.kind = kind
        self.kubeconfig = kubeconfig
        self._sa_namespace_file = sa_namespace_file
        self._resource = _KINDS[kind]
        self.client = client
        self.managed: dict[str, str] = {}  # pool -> workload name, for the workloads that exist

    async def start(self) -> None:
        if self.client is None:
            config = await asyncio.to_thread(self._load_config)
            self.namespace = self.namespace or await asyncio.to_thread(k8s_namespace, "", self._sa_namespace_file)
            self.client = AsyncClient(config, namespace=self.namespace, field_manager=FIELD_MANAGER)
        self.namespace = self.namespace or self.client.namespace
        for pool, name in self.deployments.items():
            try:
                await self.client.get(self._resource, name, namespace=self.namespace)
            except ApiError as exc:
                if exc.status.code == 404:
                    logger.info("pool not deployed connector=kubernetes pool=%s %s=%s/%s", pool, self.kind, self.namespace, name)
                    continue
                raise self._error(exc, f"read {self.kind} {name}") from None
            except _http.HTTPError as exc:
                raise ConfigError(f"cannot reach the Kubernetes API ({self._server()}): {exc}") from None
            self.managed[pool] = name
        if not self.managed:
            names = ", ".join(self.deployments.values())
            raise ConfigError(
                f"none of the pools' {self.kind}s ({names}) exists in namespace {self.namespace!r}; deploy "
                "deploy/kubernetes or name yours with --k8s-deployment POOL=NAME"
            )
        logger.info("connector started connector=kubernetes namespace=%s kind=%s pools=%s", self.namespace, self.kind, self.managed)

    def _load_config(self) -> KubeConfig:
        try:
            return KubeConfig.from_file(self.kubeconfig) if self.kubeconfig else KubeConfig.from_env()
        except Exception as exc:  # lightkube raises its own ConfigError, or OSError for a missing file
            raise ConfigError(
                f"no Kubernetes configuration ({self.kubeconfig or 'in-cluster service account or ~/.kube/config'}): {exc}"
            ) from None

    def _server(self) -> str:
        try:
            return str(self.client.config.cluster.server) if self.client is not None else "?"
        except AttributeError:
            return "?"

    def _error(self, exc: ApiError, doing: str) -> DynamoError:
        code, message = exc.status.code, exc.status.message
        if code in (401, 403):
            return ConfigError(
                f"the Kubernetes API refused to {doing} in namespace {self.namespace!r} ({code}: {message}); "
                "the planner's service account needs get on deployments and get/patch on deployments/scale"
            )
        return UnavailableError(f"could not {doing} ({code}: {message})")

    async def ready_replicas(self) -> dict[str, int]:
        assert self.client is not None
        out: dict[str, int] = {}
        for pool, name in self.managed.items():
            try:
                obj = await self.client.get(self._resource, name, namespace=self.namespace)
            except ApiError as exc:
                raise self._error(exc, f"read {self.kind} {name}") from None
            except _http.HTTPError as exc:
                raise UnavailableError(f"cannot reach the Kubernetes API ({self._server()}): {exc}") from None
            status = obj.status
            out[pool] = int(status.readyReplicas or 0) if status is not None else 0
        return out

    async def set_replicas(self, desired: dict[str, int], decision_id: int) -> None:
        assert self.client is not None
        unknown = [p for p in desired if p not in self.managed]
        if unknown:
            raise ConfigError(f"pool(s) {', '.join(unknown)} have no {self.kind} here (managed: {', '.join(self.managed)})")
        for pool, replicas in desired.items():
            name = self.managed[pool]
            try:
                scale = await self.client.get(self._resource.Scale, name, namespace=self.namespace)
                current = scale.spec.replicas if scale.spec is not None else None
                if current == replicas:
                    continue
                await self.client.patch(
                    self._resource.Scale, name, {"spec": {"replicas": replicas}},
                    namespace=self.namespace, patch_type=PatchType.MERGE,
                )
            except ApiError as exc:
                raise self._error(exc, f"scale {self.kind} {name}") from None
            except _http.HTTPError as exc:
                raise UnavailableError(f"cannot reach the Kubernetes API ({self._server()}): {exc}") from None
            logger.info(
                "scaled connector=kubernetes decision_id=%d pool=%s %s=%s/%s replicas=%s->%d",
                decision_id, pool, self.kind, self.namespace, name, current, replicas,
            )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
