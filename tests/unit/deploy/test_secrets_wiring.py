"""Every dynamod pod of every overlay can receive the cluster's security settings from Secrets:
values through ``envFrom`` of ``dynamod-runtime-auth``, files (TLS, token, passwords) mounted from
``dynamod-cluster-secrets`` at /etc/dynamod/secrets; never a secret on a command line."""

from __future__ import annotations

from typing import Any

from dynamod.shared.security.settings import SECRET_FILE_VARS, SECRET_VALUE_VARS
from tests.unit.deploy.conftest import rendered
from tests.unit.deploy.test_manifests import is_dynamod_command

SECRETS_DIR = "/etc/dynamod/secrets"


def _dynamod_pods(overlay: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod spec, container) of every container that runs dynamod."""
    out = []
    for doc in rendered(overlay):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if is_dynamod_command(c.get("command")):
                out.append((doc["metadata"]["name"], pod, c))
    return out


def test_every_dynamod_pod_takes_the_auth_secret_as_env(overlay: str) -> None:
    pods = _dynamod_pods(overlay)
    assert len(pods) >= 3  # frontend, planner, at least one worker pool
    for name, _, c in pods:
        refs = [e["secretRef"] for e in c.get("envFrom", []) if "secretRef" in e]
        assert {"name": "dynamod-runtime-auth", "optional": True} in refs, name
        # After the ConfigMap, so a key in the Secret wins over the same key in the ConfigMap.
        kinds = [next(iter(e)) for e in c["envFrom"]]
        assert kinds.index("secretRef") > kinds.index("configMapRef"), name


def test_every_dynamod_pod_mounts_the_secret_files(overlay: str) -> None:
    for name, pod, c in _dynamod_pods(overlay):
        [mount] = [m for m in c.get("volumeMounts", []) if m["mountPath"] == SECRETS_DIR]
        assert mount.get("readOnly") is True, name
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "dynamod-cluster-secrets", name
        assert volume["secret"]["optional"] is True, name  # a cluster without security still starts
        assert volume["secret"]["defaultMode"] & 0o007 == 0, name  # not world-readable


def test_no_secret_travels_on_a_command_line_or_as_a_literal(overlay: str) -> None:
    for name, _, c in _dynamod_pods(overlay):
        argv = " ".join(c.get("command", []) + c.get("args", []))
        for var in SECRET_VALUE_VARS:
            assert var not in argv, name
        assert "--cluster-token" not in argv and "password" not in argv.lower(), name
        for e in c.get("env", []):
            assert not (e["name"] in SECRET_VALUE_VARS and "value" in e), (name, e["name"])
            if e["name"] in SECRET_FILE_VARS and "value" in e:
                assert e["value"].startswith(SECRETS_DIR + "/"), (name, e)
