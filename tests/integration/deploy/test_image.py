"""The CPU image (``scripts/build_image.sh cpu``) runs and serves (issue 28, item 1).

Runs when podman and the image ``ghcr.io/dynamod/dynamod:<version>`` are on this machine (the build
takes minutes, so the suite does not build it); skips and says why otherwise. The container runs
its default command (``dynamod up``) as user 1000 under tini, answers a completion through a
published port, passes its own HEALTHCHECK, carries no pip, and stops cleanly on SIGTERM.

Unprivileged containers with cgroup v1 cannot use podman's defaults (crun: "cgroups in hybrid
mode not supported"; rlimits that cannot be raised): the test then retries with runc, cgroupfs and
the current limits, as deploy/README.md ("Images") describes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.servers import free_port, wait_until

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[3]


def _image() -> str:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_image.sh"), "tags"], capture_output=True, text=True,
                         check=True, timeout=30).stdout.split()
    return next(t for t in out if "/dynamod:" in t)


def _limits() -> list[str]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ["--ulimit", f"nofile={soft}:{hard}", "--ulimit", "nproc=4096:4096"]


def _podman_variants() -> list[tuple[list[str], list[str]]]:
    """(global flags, run flags) to try in turn: podman's defaults, then runc with cgroupfs."""
    return [([], []), (["--runtime", "runc", "--cgroup-manager", "cgroupfs"], _limits())]


@pytest.fixture(scope="module")
def podman() -> Iterator[tuple[list[str], list[str], str]]:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    image = _image()
    if subprocess.run(["podman", "image", "exists", image], timeout=30).returncode != 0:
        pytest.skip(f"{image} is not built here (scripts/build_image.sh cpu)")
    errors = []
    for opts, run_opts in _podman_variants():
        probe = subprocess.run(["podman", *opts, "run", "--rm", *run_opts, "--entrypoint", "/bin/true", image],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            yield ["podman", *opts], run_opts, image
            return
        errors.append(f"podman {' '.join(opts)}: {probe.stderr.strip().splitlines()[-1:]}")
    pytest.skip("this machine cannot run containers: " + "; ".join(errors))


def test_image_serves_a_request_and_stops_cleanly(podman: tuple[list[str], list[str], str]) -> None:
    cmd, run_opts, image = podman
    name = f"dynamod-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    started = subprocess.run([*cmd, "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", *run_opts, image],
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{base}/v1/models", timeout=2).status_code == 200, 90, interval=0.5,
                   what="the containerized cluster")
        reply = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 5}, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5, reply.text
        health = subprocess.run([*cmd, "healthcheck", "run", name], capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, health.stdout + health.stderr
        inside = subprocess.run(
            [*cmd, "exec", name, "sh", "-c", "id -u; tr '\\0' ' ' </proc/1/cmdline; echo; "
             "ls /opt/dynamod/bin; command -v gcc cc pip pip3 || true"],
            capture_output=True, text=True, timeout=60,
        )
        lines = inside.stdout.splitlines()
        assert lines[0] == "1000", inside.stdout
        assert lines[1].startswith("/usr/bin/tini "), "tini is PID 1"
        assert not re.search(r"^(pip|pip3|gcc|cc)$|/(pip|pip3|gcc|cc)$", "\n".join(lines[2:]), re.M), inside.stdout
        stopped = subprocess.run([*cmd, "stop", "-t", "30", name], capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        code = subprocess.run([*cmd, "inspect", name, "--format", "{{.State.ExitCode}}"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        assert code == "0", "SIGTERM through tini stops `dynamod up` cleanly"
    finally:
        subprocess.run([*cmd, "rm", "-f", name], capture_output=True, timeout=60)
