#!/usr/bin/env bash
# Builds dynamod's container images without any container registry: the base is a Debian root
# filesystem made by mmdebstrap from the Debian archive, the project goes in from its wheel.
#
#   scripts/build_image.sh cpu        ghcr.io/dynamod/dynamod:<version>       (deploy/images/cpu.Containerfile)
#   scripts/build_image.sh vllm       ghcr.io/dynamod/dynamod-vllm:<version>  (deploy/images/vllm.Containerfile;
#                                     FROM nvcr.io/nvidia/cuda, so only where that registry is reachable)
#   scripts/build_image.sh rootfs     the CPU image's root filesystem as a directory, for hosts that
#                                     cannot run podman (chroot into it; see deploy/README.md)
#   scripts/build_image.sh tags       print the image references this script builds, one a line
#
# <version> is pyproject.toml's; the Kubernetes manifests name exactly these references
# (tests/unit/deploy/test_images.py keeps them in step). Work files go to $DYN_IMAGE_BUILD_DIR
# (default /work/image-build, never the repository). Needs: mmdebstrap, podman (or buildah), and
# pip with access to a Python package index (or a filled wheelhouse).
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SUITE (bookworm),
# EXTRAS (pip extras for the CPU image, e.g. "[planner]"), REGISTRY (ghcr.io/dynamod),
# PODMAN_OPTS (global podman flags) and PODMAN_BUILD_OPTS (extra `podman build` flags). Inside an
# unprivileged container with cgroup v1 and locked rlimits (the machine this was built on), crun
# refuses to start ("cgroups in hybrid mode not supported"); what works there:
#   PODMAN_OPTS="--runtime runc --cgroup-manager cgroupfs" \
#   PODMAN_BUILD_OPTS="--network host --ulimit nofile=$(ulimit -n):$(ulimit -Hn) --ulimit nproc=4096:4096"
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY=${REGISTRY:-ghcr.io/dynamod}
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
CPU_IMAGE="$REGISTRY/dynamod:$VERSION"
VLLM_IMAGE="$REGISTRY/dynamod-vllm:$VERSION"
BASE_IMAGE=localhost/dynamod-base:${DEBIAN_SUITE:-bookworm}
WORK=${DYN_IMAGE_BUILD_DIR:-/work/image-build}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
EXTRAS=${EXTRAS:-}
# Base packages: the interpreter (bookworm's python3 is 3.11, what the wheels are built for), venv
# for the build stage, tini as PID 1, CA certificates for etcd/NATS TLS and model downloads, and
# passwd for useradd. No compiler: every dependency arrives as a wheel.
BASE_PACKAGES=python3,python3-venv,tini,ca-certificates,passwd

PODMAN_OPTS=${PODMAN_OPTS:-}
PODMAN_BUILD_OPTS=${PODMAN_BUILD_OPTS:-}
# shellcheck disable=SC2086  # the option strings are lists of flags
podman() { command podman $PODMAN_OPTS "$@"; }

log() { printf 'build_image: %s\n' "$*" >&2; }

wheelhouse() {
  # The project's wheel plus a wheel of every dependency, built/downloaded on this host (same
  # CPython 3.11 and glibc family as the image), so the image build itself needs no network.
  rm -rf "$WORK/context/wheelhouse"
  mkdir -p "$WORK/context/wheelhouse"
  python3 -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$WORK/context/wheelhouse" ".$EXTRAS"
  log "wheelhouse: $(ls "$WORK/context/wheelhouse" | wc -l) wheels in $WORK/context/wheelhouse"
}

base_rootfs() {
  # A minimal Debian root filesystem straight from the archive: no registry, reproducible from
  # the suite and the package list.
  if [ ! -f "$WORK/base-$SUITE.tar" ]; then
    log "mmdebstrap $SUITE ($BASE_PACKAGES) from $MIRROR"
    mmdebstrap --variant=minbase --include="$BASE_PACKAGES" \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
      "$SUITE" "$WORK/base-$SUITE.tar" "$MIRROR"
  fi
}

import_base() {
  base_rootfs
  podman import --change 'CMD ["/bin/bash"]' "$WORK/base-$SUITE.tar" "$BASE_IMAGE" >/dev/null
  log "base image $BASE_IMAGE"
}

build_cpu() {
  mkdir -p "$WORK/context"
  wheelhouse
  import_base
  cp deploy/images/cpu.Containerfile "$WORK/context/Containerfile"
  # --format docker keeps HEALTHCHECK (the OCI image format has no field for it).
  # shellcheck disable=SC2086
  podman build $PODMAN_BUILD_OPTS --format docker --build-arg BASE="$BASE_IMAGE" --build-arg EXTRAS="$EXTRAS" \
    -t "$CPU_IMAGE" "$WORK/context"
  log "built $CPU_IMAGE"
}

build_vllm() {
  # Only the project's own wheel goes in the context; vLLM and CUDA wheels come from the index.
  rm -rf "$WORK/vllm-context"
  mkdir -p "$WORK/vllm-context/dist"
  python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$WORK/vllm-context/dist" .
  # shellcheck disable=SC2086
  podman build $PODMAN_BUILD_OPTS --format docker -t "$VLLM_IMAGE" -f deploy/images/vllm.Containerfile "$WORK/vllm-context"
  log "built $VLLM_IMAGE"
}

build_rootfs() {
  # What the CPU Containerfile does, as plain directories, for a host without a container
  # runtime: base rootfs -> venv built in a throwaway copy (the build stage) -> the venv copied
  # into a fresh base (the final stage) -> the same non-root user.
  mkdir -p "$WORK/context"
  wheelhouse
  base_rootfs
  local stage="$WORK/rootfs-build" final="$WORK/rootfs"
  rm -rf "$stage" "$final"
  mkdir -p "$stage" "$final"
  tar -xf "$WORK/base-$SUITE.tar" -C "$stage"
  tar -xf "$WORK/base-$SUITE.tar" -C "$final"
  cp -r "$WORK/context/wheelhouse" "$stage/wheelhouse"
  chroot "$stage" /bin/sh -ec "
    python3 -m venv /opt/dynamod
    /opt/dynamod/bin/pip install --quiet --no-index --find-links /wheelhouse --no-compile 'dynamod$EXTRAS'
    /opt/dynamod/bin/pip uninstall --quiet -y pip setuptools wheel
    /opt/dynamod/bin/python -m compileall -q /opt/dynamod/lib
    /opt/dynamod/bin/dynamod --help >/dev/null"
  cp -a "$stage/opt/dynamod" "$final/opt/dynamod"
  rm -rf "$stage"
  chroot "$final" /bin/sh -ec "
    groupadd --system --gid 1000 dynamod
    useradd --system --uid 1000 --gid 1000 --home-dir /var/lib/dynamod --create-home --shell /usr/sbin/nologin dynamod"
  log "root filesystem in $final ($(du -sh "$final" | cut -f1))"
}

case "${1:-}" in
  cpu) build_cpu ;;
  vllm) build_vllm ;;
  rootfs) build_rootfs ;;
  tags) printf '%s\n' "$CPU_IMAGE" "$VLLM_IMAGE" ;;
  *) echo "usage: $0 cpu|vllm|rootfs|tags" >&2; exit 2 ;;
esac
