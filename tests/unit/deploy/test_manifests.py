"""deploy/kubernetes: every overlay renders, every document validates against the Kubernetes
schemas (kubernetes-validate, offline), and the pieces refer to each other correctly: Services
select pods and name their ports, probes hit declared ports and the routes the daemons serve, the
planner's RoleBinding names the ServiceAccount it runs as with exactly the rights it needs, and
every container's dynamod flags parse with that role's own parser."""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy.conftest import DEPLOY, OVERLAYS, rendered
from tests.unit.deploy.kustomize_lite import CLUSTER_SCOPED, KustomizeLiteError, pod_spec, render, resource_id

# The oldest minor we support (EKS/GKE/AKS all still offer it) and a current one.
KUBERNETES_VERSIONS = ("1.30.0", "1.33.0")
NAMESPACE = "dynamod"
POOL_DEPLOYMENTS = {
    "agg": {"dynamod-agg": "agg"},
    "disagg": {"dynamod-prefill": "prefill", "dynamod-decode": "decode"},
    "dev": {"dynamod-agg": "agg"},
}
GPU_OVERLAYS = ("agg", "disagg")
WORKER_ROLES = ("agg", "prefill", "decode")


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Long-running pods (Deployments, StatefulSets): selectors, probes, Services."""
    return [d for d in docs if pod_spec(d) is not None and d["kind"] != "Job"]


def _pod_owners(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Everything that runs a pod, one-off Jobs included."""
    return [d for d in docs if pod_spec(d) is not None]


# Secrets without which a piece must not start (it would run open): etcd's and NATS's TLS and
# users. Every other Secret is a placeholder a cluster may go without.
REQUIRED_SECRETS = frozenset({"dynamod-etcd-tls", "dynamod-etcd-auth", "dynamod-nats-tls", "dynamod-nats-auth"})


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


# The image's init in front of dynamod: tini reaps the engine's children (deploy/images).
DYNAMOD_COMMAND = ["/usr/bin/tini", "--", "dynamod"]


def is_dynamod_command(command: list[str] | None) -> bool:
    return command == DYNAMOD_COMMAND


def _dynamod_containers(docs: list[dict[str, Any]]):
    for doc in _workloads(docs):
        for c in pod_spec(doc)["containers"]:
            if is_dynamod_command(c.get("command")):
                yield doc, c


def _flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _resolved_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """What the container sees from its ConfigMaps and plain values (Secrets are placeholders)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_find(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = "<from " + next(iter(var["valueFrom"])) + ">"
    return env


def _container_port(container: dict[str, Any], port: int | str) -> int:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    raise AssertionError(f"container {container['name']} declares no port {port!r}: {container.get('ports')}")


# -- rendering --------------------------------------------------------------------------------


def test_overlays_render_to_distinct_resources(overlay: str) -> None:
    docs = rendered(overlay)
    ids = [resource_id(d) for d in docs]
    assert len(ids) == len(set(ids))
    assert {"Deployment", "StatefulSet", "Service", "ServiceAccount", "Role", "RoleBinding"} <= {d["kind"] for d in docs}


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def test_lite_renderer_matches_kustomize(overlay: str) -> None:
    """Where kustomize (or kubectl) is installed, our renderer must agree with it exactly, list
    order included (env order decides what a $(VAR) reference sees)."""
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed; the tests use kustomize_lite alone")
    try:
        out = subprocess.run(
            [*command, str(DEPLOY / "kubernetes" / "overlays" / overlay)],
            capture_output=True, text=True, timeout=120, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{command[0]} did not run: {exc}")
    assert out.returncode == 0, out.stderr
    theirs = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=resource_id)
    ours = sorted(rendered(overlay), key=resource_id)
    assert [resource_id(d) for d in ours] == [resource_id(d) for d in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a == b, f"kustomize_lite and {command[0]} disagree on {resource_id(a)}"


def test_lite_renderer_refuses_what_it_does_not_implement(tmp_path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeLiteError, match="commonLabels"):
        render(tmp_path)


# -- schemas -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_validates_against_the_kubernetes_schema(overlay: str, version: str) -> None:
    failures = []
    for doc in rendered(overlay):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{resource_id(doc)}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{resource_id(doc)}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_the_validator_catches_a_misspelt_field() -> None:
    """Strict schemas reject unknown fields: a typo in a manifest cannot pass silently."""
    doc = _find(rendered("dev"), "Deployment", "dynamod-frontend")
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = bad["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[0], strict=True)


# -- cross-references --------------------------------------------------------------------------


def test_everything_lives_in_one_namespace(overlay: str) -> None:
    for doc in rendered(overlay):
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == NAMESPACE
        elif doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == NAMESPACE, resource_id(doc)


def test_workload_selectors_match_their_pod_labels(overlay: str) -> None:
    for doc in _workloads(rendered(overlay)):
        selector = doc["spec"]["selector"]["matchLabels"]
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), resource_id(doc)


def test_services_select_pods_and_name_their_ports(overlay: str) -> None:
    docs = rendered(overlay)
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [w for w in _workloads(docs) if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pods"
        for workload in pods:
            containers = pod_spec(workload)["containers"]
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert any(
                    target in (p.get("name"), p["containerPort"]) for c in containers for p in c.get("ports", [])
                ), f"Service {svc['metadata']['name']} port {target!r} is no port of {resource_id(workload)}"


def test_statefulsets_name_an_existing_headless_service(overlay: str) -> None:
    docs = rendered(overlay)
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        svc = _find(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None"
        assert svc["spec"].get("publishNotReadyAddresses") is True  # peers meet before they are ready


def test_probes_hit_declared_ports(overlay: str) -> None:
    for doc in _workloads(rendered(overlay)):
        for c in pod_spec(doc)["containers"]:
            probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
            assert len(probes) >= 2, f"{resource_id(doc)} {c['name']}: readiness and liveness probes expected"
            for probe in probes:
                _container_port(c, probe["httpGet"]["port"])


def test_referenced_configmaps_claims_and_accounts_exist(overlay: str) -> None:
    docs = rendered(overlay)
    for doc in _pod_owners(docs):
        spec = pod_spec(doc)
        if "serviceAccountName" in spec:
            _find(docs, "ServiceAccount", spec["serviceAccountName"])
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                _find(docs, "ConfigMap", vol["configMap"]["name"])
            if "persistentVolumeClaim" in vol:
                _find(docs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
            if "secret" in vol:
                required = vol["secret"]["secretName"] in REQUIRED_SECRETS
                assert vol["secret"].get("optional") is (not required), (
                    f"{resource_id(doc)}: Secret {vol['secret']['secretName']} must be "
                    + ("required (etcd and NATS never start open)" if required else "an optional placeholder")
                )
        for c in spec["containers"]:
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    _find(docs, "ConfigMap", source["configMapRef"]["name"])
                else:
                    assert source["secretRef"].get("optional") is True
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref.get("optional") is True, f"{resource_id(doc)}: Secret {ref['name']} is a placeholder"


def test_no_secret_values_are_shipped(overlay: str) -> None:
    """Credentials come later from Secrets the operator creates; none ship in plain text."""
    assert not [d for d in rendered(overlay) if d["kind"] == "Secret"]


def test_env_references_see_their_variables(overlay: str) -> None:
    """$(VAR) only expands when VAR is defined above it (env) or by envFrom."""
    docs = rendered(overlay)
    for doc in _workloads(docs):
        for c in pod_spec(doc)["containers"]:
            known = set()
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    known |= set(_find(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
            for var in c.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", var.get("value", "")):
                    assert ref in known, f"{resource_id(doc)} {c['name']}: {var['name']} uses $({ref}) before it is defined"
                known.add(var["name"])


def test_etcd_initial_cluster_lists_every_replica(overlay: str) -> None:
    sts = _find(rendered(overlay), "StatefulSet", "dynamod-etcd")
    env = {v["name"]: v.get("value") for v in pod_spec(sts)["containers"][0]["env"]}
    members = [m.split("=", 1)[0] for m in env["ETCD_INITIAL_CLUSTER"].split(",")]
    assert members == [f"dynamod-etcd-{i}" for i in range(sts["spec"]["replicas"])]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_nats_runs_jetstream() -> None:
    for overlay in OVERLAYS:
        config = _find(rendered(overlay), "ConfigMap", "dynamod-nats-config")["data"]["nats-server.conf"]
        assert re.search(r"^jetstream \{", config, re.M)
        assert "listen: 0.0.0.0:4222" in config


# -- dynamod roles -----------------------------------------------------------------------------


def test_frontend_serves_port_8000_with_health_routes(overlay: str) -> None:
    docs = rendered(overlay)
    dep = _find(docs, "Deployment", "dynamod-frontend")
    (c,) = pod_spec(dep)["containers"]
    http_port = int(_flag(c["args"], "--http-port"))
    assert _flag(c["args"], "--role") == "frontend"
    # The frontend answers /health and /live on its HTTP port (daemon/frontend/app.py).
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert _container_port(c, c["readinessProbe"]["httpGet"]["port"]) == http_port == 8000
    assert _container_port(c, c["livenessProbe"]["httpGet"]["port"]) == http_port
    svc = _find(docs, "Service", "dynamod-frontend")
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000]
    env = _resolved_env(docs, c)
    assert env["DYN_HTTP_HOST"] == "0.0.0.0"
    assert "preStop" in c["lifecycle"]
    grace = float(_flag(c["args"], "--shutdown-grace"))
    assert pod_spec(dep)["terminationGracePeriodSeconds"] >= grace + 5


def test_dynamod_pods_reach_etcd_and_nats_through_their_services(overlay: str) -> None:
    docs = rendered(overlay)
    etcd = _find(docs, "Service", "dynamod-etcd")
    nats = _find(docs, "Service", "dynamod-nats")
    containers = list(_dynamod_containers(docs))
    assert containers
    for doc, c in containers:
        env = _resolved_env(docs, c)
        assert env["DYN_DISCOVERY_BACKEND"] == "etcd"
        assert env["DYN_NAMESPACE"]
        assert env["ETCD_ENDPOINTS"] == f"https://{etcd['metadata']['name']}:{etcd['spec']['ports'][0]['port']}"
        assert env["NATS_SERVER"] == f"tls://{nats['metadata']['name']}:{nats['spec']['ports'][0]['port']}"
        # The request plane must advertise an address other pods can reach.
        assert env["DYN_HOST"] == "$(POD_IP)", resource_id(doc)


def test_worker_pools_are_the_planner_deployments(overlay: str) -> None:
    docs = rendered(overlay)
    pools = {
        d["metadata"]["name"]: d for d in docs
        if d["kind"] == "Deployment" and d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] in WORKER_ROLES
    }
    assert {name: POOL_DEPLOYMENTS[overlay][name] for name in pools} == POOL_DEPLOYMENTS[overlay]
    for name, role in POOL_DEPLOYMENTS[overlay].items():
        dep = pools[name]
        (c,) = pod_spec(dep)["containers"]
        args = c["args"]
        assert _flag(args, "--role") == role
        assert _flag(args, "--engine") == ("mocker" if overlay == "dev" else "vllm")
        # The --system-port status server: /health for readiness (and startup), /live for liveness.
        system_port = int(_flag(args, "--system-port"))
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/live"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert _container_port(c, c[probe]["httpGet"]["port"]) == system_port
        env = _resolved_env(docs, c)
        assert env["DYN_SYSTEM_HOST"] == "0.0.0.0"  # the kubelet and Prometheus reach it
        # SIGTERM drains: --shutdown-grace for in-flight requests, again for the runtime, margin.
        grace = float(_flag(args, "--shutdown-grace"))
        assert pod_spec(dep)["terminationGracePeriodSeconds"] > 2 * grace
        if overlay in GPU_OVERLAYS:
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert env["DYN_MODEL"].startswith("/models/")
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/models" in mounts
        else:
            assert "nvidia.com/gpu" not in str(c["resources"])


def test_only_workers_mount_the_model_volume(overlay: str) -> None:
    """Frontends tokenize with the files workers publish in discovery (shared/protocol/model_files.py),
    so they need no copy of the model: only worker pools claim the model volume (issue 28)."""
    for doc in _workloads(rendered(overlay)):
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod_spec(doc).get("volumes", [])
                  if "persistentVolumeClaim" in v}
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        if "dynamod-models" in claims:
            assert component in ("agg", "prefill", "decode"), f"{resource_id(doc)} mounts the model volume"


def test_planner_rbac_is_exactly_deployments_and_their_scale(overlay: str) -> None:
    docs = rendered(overlay)
    planner = _find(docs, "Deployment", "dynamod-planner")
    spec = pod_spec(planner)
    account = spec["serviceAccountName"]
    assert spec["automountServiceAccountToken"] is True
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (binding,) = bindings
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": planner["metadata"]["namespace"]}]
    assert binding["roleRef"]["kind"] == "Role"
    role = _find(docs, "Role", binding["roleRef"]["name"])
    grants = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants[(group, resource)] = (sorted(rule["verbs"]), sorted(rule.get("resourceNames", [])))
    assert set(grants) == {("apps", "deployments"), ("apps", "deployments/scale")}
    assert grants[("apps", "deployments")] == (["get", "list", "watch"], [])
    verbs, names = grants[("apps", "deployments/scale")]
    assert verbs == ["get", "patch", "update"]
    assert set(POOL_DEPLOYMENTS[overlay]) <= set(names)
    # Only the planner gets an API token.
    for doc in _workloads(docs):
        if doc is not planner:
            assert pod_spec(doc).get("automountServiceAccountToken") is False, resource_id(doc)


def test_planner_runs_the_kubernetes_connector_with_a_status_server(overlay: str) -> None:
    dep = _find(rendered(overlay), "Deployment", "dynamod-planner")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    (c,) = pod_spec(dep)["containers"]
    assert _flag(c["args"], "--role") == "planner"
    assert _flag(c["args"], "--connector") == "kubernetes"
    system_port = int(_flag(c["args"], "--system-port"))
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert _container_port(c, c["readinessProbe"]["httpGet"]["port"]) == system_port


def test_dynamod_pods_are_annotated_for_prometheus(overlay: str) -> None:
    for doc, c in _dynamod_containers(rendered(overlay)):
        annotations = doc["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", resource_id(doc)
        assert annotations.get("prometheus.io/path") == "/metrics"
        port = int(annotations["prometheus.io/port"])
        _container_port(c, port)
        served = _flag(c["args"], "--system-port") or _flag(c["args"], "--http-port")
        assert port == int(served), f"{resource_id(doc)}: Prometheus scrapes {port}, /metrics is on {served}"


def test_every_dynamod_command_line_parses_with_its_role(overlay: str) -> None:
    """The flags in the manifests are flags the roles have (role modules from dynamod.daemon.cli)."""
    from dynamod.daemon import cli

    roles = cli._available(cli.ROLES)
    missing = []
    for doc, c in _dynamod_containers(rendered(overlay)):
        role = _flag(c["args"], "--role")
        if role not in roles:
            missing.append(f"{resource_id(doc)} runs `dynamod --role {role}`, which dynamod.daemon.cli does not offer yet")
            continue
        rest = [a for i, a in enumerate(c["args"]) if not (a == "--role" or (i and c["args"][i - 1] == "--role"))]
        module = importlib.import_module(roles[role])
        parser = argparse.ArgumentParser(prog=f"dynamod --role {role}", exit_on_error=False)
        module.add_args(parser)
        try:
            if hasattr(module, "parse_args"):
                module.parse_args(parser, rest)
            else:
                parser.parse_args(rest)
        except (SystemExit, argparse.ArgumentError) as exc:
            missing.append(f"{resource_id(doc)}: `dynamod --role {role} {' '.join(rest)}` does not parse: {exc}")
    assert not missing, "\n".join(missing)
