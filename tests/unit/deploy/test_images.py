"""Every image the Kubernetes manifests name is one something builds (issue 28, item 1-2): the
dynamod images are exactly the tags ``scripts/build_image.sh`` builds (its ``tags`` command), and
the others are pinned upstream images listed here with why. The Containerfiles keep the shape
deploy/README.md promises: multi-stage, nothing of the build in the final stage, a non-root user,
tini as PID 1, a /live healthcheck."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.unit.deploy.conftest import DEPLOY, OVERLAYS, rendered
from tests.unit.deploy.kustomize_lite import pod_spec

ROOT = DEPLOY.parent
BUILD = ROOT / "scripts" / "build_image.sh"
CONTAINERFILES = {"cpu": DEPLOY / "images" / "cpu.Containerfile", "vllm": DEPLOY / "images" / "vllm.Containerfile"}
# Images dynamod does not build, pulled from their publishers: pinned to a version, never latest.
UPSTREAM = {
    "quay.io/coreos/etcd": "etcd's own release image (base/etcd.yaml)",
    "docker.io/bitnami/etcd": "etcdctl for the one-shot auth Job (base/etcd-auth-job.yaml)",
    "nats": "the NATS server's official image (base/nats.yaml)",
}
OWN_PREFIX = "ghcr.io/dynamod/"


def _built_tags() -> set[str]:
    out = subprocess.run(["bash", str(BUILD), "tags"], capture_output=True, text=True, timeout=30, check=True).stdout
    return set(out.split())


def _manifest_images() -> dict[str, set[str]]:
    images: dict[str, set[str]] = {}
    for overlay in OVERLAYS:
        for doc in rendered(overlay):
            spec = doc.get("spec", {})
            if "template" not in spec and "jobTemplate" not in spec:
                continue
            pod = pod_spec(doc)
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                images.setdefault(c["image"], set()).add(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}")
    return images


def test_build_script_tags_are_the_project_version() -> None:
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    assert _built_tags() == {f"{OWN_PREFIX}dynamod:{version}", f"{OWN_PREFIX}dynamod-vllm:{version}"}


def test_every_image_in_a_manifest_is_built_by_the_recipe_or_a_pinned_upstream() -> None:
    built = _built_tags()
    problems = []
    for image, where in sorted(_manifest_images().items()):
        name, _, tag = image.rpartition(":")
        if image.startswith(OWN_PREFIX):
            if image not in built:
                problems.append(f"{image} ({sorted(where)}) is not a tag scripts/build_image.sh builds: {sorted(built)}")
        elif name not in UPSTREAM:
            problems.append(f"{image} ({sorted(where)}) is neither built here nor a listed upstream image")
        elif not tag or tag == "latest":
            problems.append(f"{image} must be pinned to a version")
    assert not problems, "\n".join(problems)
    assert any(i.startswith(OWN_PREFIX + "dynamod:") for i in _manifest_images()), "the CPU image is used somewhere"


def _stages(text: str) -> list[str]:
    return re.split(r"^FROM ", text, flags=re.M)[1:]


@pytest.mark.parametrize("image", sorted(CONTAINERFILES))
def test_containerfile_shape(image: str) -> None:
    text = CONTAINERFILES[image].read_text()
    stages = _stages(text)
    assert len(stages) >= 2 and " AS build" in stages[0], "multi-stage: a build stage, then the final one"
    final = stages[-1]
    assert "COPY --from=build /opt/dynamod /opt/dynamod" in final
    assert "wheelhouse" not in final and "/dist" not in final, "no build input in the final stage"
    for tool in ("gcc", "build-essential", "python3-pip", "python3-dev"):
        assert tool not in final, f"{tool} in the final stage"
    assert "pip uninstall -y pip" in stages[0], "the venv copied into the final stage carries no pip"
    user = re.search(r"^USER (\S+)", final, re.M)
    assert user and user.group(1).split(":")[0] not in ("0", "root")
    assert re.search(r'^ENTRYPOINT \["/usr/bin/tini", .*"dynamod"\]', final, re.M)
    assert "HEALTHCHECK" in final and "/live" in final


def test_image_user_is_the_one_the_pods_run_as() -> None:
    """The pods' runAsUser is the image's USER: files the image owns stay readable."""
    uid = re.search(r"^USER (\d+)", _stages(CONTAINERFILES["cpu"].read_text())[-1], re.M).group(1)  # type: ignore[union-attr]
    for overlay in OVERLAYS:
        for doc in rendered(overlay):
            if doc["kind"] == "Deployment" and doc["metadata"]["name"].startswith("dynamod-"):
                assert str(pod_spec(doc)["securityContext"]["runAsUser"]) == uid, doc["metadata"]["name"]


def test_build_script_keeps_artefacts_out_of_the_repository() -> None:
    text = BUILD.read_text()
    assert "WORK=${DYN_IMAGE_BUILD_DIR:-/work/image-build}" in text
    assert "mmdebstrap" in text and "--no-index" in CONTAINERFILES["cpu"].read_text()
    result = subprocess.run(["bash", "-n", str(BUILD)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    usage = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_kubernetes_readme_and_main_readme_agree_frontends_need_no_model() -> None:
    k8s = (DEPLOY / "kubernetes" / "README.md").read_text()
    assert "frontends mount it too" not in k8s
    assert "need no copy of the model" in k8s
    assert "no copy of the model" in (ROOT / "README.md").read_text()


def test_image_recipes_are_documented() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for needle in ("scripts/build_image.sh cpu", "scripts/build_image.sh vllm", "podman run"):
        assert needle in readme, needle
    assert Path(CONTAINERFILES["vllm"]).read_text().count("nvcr.io/nvidia/cuda") >= 1
