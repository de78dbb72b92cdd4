"""The part of kustomize that deploy/kubernetes uses, so the tests render the overlays without the
binary: ``resources`` (files and kustomization directories), ``patches`` given by ``path`` (strategic
merge, target named by the patch's own kind and name), ``images`` and ``namespace``. Anything else in
a kustomization.yaml, or a strategic-merge directive (``$patch`` ...), raises: extend this module
(and check it against ``kubectl kustomize``, which test_manifests does where the binary exists)
before using it in the manifests.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}

# Kinds without a namespace among those a dynamod deployment could use.
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
    "CustomResourceDefinition", "PriorityClass", "RuntimeClass", "IngressClass",
}

# Strategic-merge keys of the lists our manifests patch (k8s.io/api patchMergeKey). A list field
# not named here is replaced as a whole, as Kubernetes does for lists without a merge key
# (args, command, envFrom, tolerations, ...).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class KustomizeLiteError(Exception):
    pass


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resource_id(doc: dict[str, Any]) -> tuple[str, str, str]:
    return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def render(directory: Path) -> list[dict[str, Any]]:
    """The documents ``kustomize build directory`` would print (in another order)."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeLiteError(f"{directory} has no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeLiteError(f"{kfile}: kustomize_lite does not implement {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        docs.extend(render(path) if path.is_dir() else load_documents(path))
    seen: set[tuple[str, str, str]] = set()
    for doc in docs:
        rid = resource_id(doc)
        if rid in seen:
            raise KustomizeLiteError(f"{kfile}: {rid} is declared twice")
        seen.add(rid)
    for patch_entry in k.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise KustomizeLiteError(f"{kfile}: only patches with a path are implemented, got {patch_entry}")
        (patch,) = load_documents(directory / patch_entry["path"])
        targets = [
            d for d in docs
            if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]
            and _group(d) == _group(patch)
        ]
        if len(targets) != 1:
            raise KustomizeLiteError(
                f"{kfile}: patch {patch_entry['path']} matches {len(targets)} resources, expected one"
            )
        body = {key: value for key, value in patch.items() if key not in ("apiVersion", "kind", "metadata")}
        merged = strategic_merge(targets[0], body)
        targets[0].clear()
        targets[0].update(merged)
    for image in k.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    namespace = k.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] == "Namespace":
                doc["metadata"]["name"] = namespace
            elif doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    return docs


def _group(doc: dict[str, Any]) -> str:
    api = doc["apiVersion"]
    return api.split("/")[0] if "/" in api else ""


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(patch, dict):
        for key in patch:
            if key.startswith("$"):
                raise KustomizeLiteError(f"strategic-merge directive {key} is not implemented")
        if not isinstance(base, dict):
            return copy.deepcopy(patch)
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field, base + patch)
        if key is None:
            return copy.deepcopy(patch)
        # As Kubernetes' strategic merge (and kustomize) order it without $setElementOrder: the
        # patch's items first, in its order, then the base's untouched items. Order matters:
        # $(VAR) in env only sees variables defined above it.
        out = []
        for item in patch:
            if not isinstance(item, dict) or key(item) is None:
                raise KustomizeLiteError(f"list {field!r}: patch item without its merge key: {item}")
            match = [existing for existing in base if key(existing) == key(item)]
            out.append(strategic_merge(match[0], item, field) if match else copy.deepcopy(item))
        patched = {key(item) for item in patch}
        out.extend(copy.deepcopy(existing) for existing in base if key(existing) not in patched)
        return out
    return copy.deepcopy(patch)


def _merge_key(field: str, items: list[Any]):
    if field == "ports":
        # containers[].ports merge on containerPort, a Service's on port.
        name = "containerPort" if any(isinstance(i, dict) and "containerPort" in i for i in items) else "port"
        return lambda item: item.get(name)
    if field == "volumeClaimTemplates":
        return lambda item: (item.get("metadata") or {}).get("name")
    if field in MERGE_KEYS:
        name = MERGE_KEYS[field]
        return lambda item: item.get(name)
    return None


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return doc["spec"]["template"]["spec"]
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None


def _set_image(doc: dict[str, Any], image: dict[str, Any]) -> None:
    spec = pod_spec(doc)
    if spec is None:
        return
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        ref = container.get("image", "")
        name, tag, digest = _split_image(ref)
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{name}@{image['digest']}"
            continue
        tag = image.get("newTag", tag)
        container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest and "newTag" not in image else "")


def _split_image(ref: str) -> tuple[str, str, str]:
    digest = ""
    if "@" in ref:
        ref, digest = ref.split("@", 1)
    tag = ""
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        ref, tag = ref.rsplit(":", 1)
    return ref, tag, digest
