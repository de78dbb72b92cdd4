"""Support for the real-vLLM end-to-end tests (no tests here).

vLLM lives in its own virtual environment (scripts/setup_vllm_env.sh), so worker daemons run with
that environment's Python while the frontend, the test and the OpenAI client run with this one.
``vllm_python()`` finds the environment without starting Python in it (importing vLLM takes
seconds): ``DYN_VLLM_PYTHON``, else this interpreter when vLLM is installed here, else the default
venv built by the setup script.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.servers import free_port
from tests.integration.frontend.test_frontend_support import Proc, clean_env

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VENV = Path(os.environ.get("DYN_VLLM_VENV", "~/.cache/dynamod/vllm-venv")).expanduser()
ENGINE_START_TIMEOUT_S = 300.0


def nixl_importable(python: str) -> bool:
    """Whether ``import nixl`` (the name vLLM's connector imports) works in that interpreter:
    checked by file, since starting it would import nothing useful and take time."""
    venv = Path(python).parent.parent  # not resolved: a venv's python links to the base interpreter
    return any(venv.glob("lib/python3*/site-packages/nixl/__init__.py")) and (
        any(venv.glob("lib/python3*/site-packages/nixl_cu1*/__init__.py"))
    )


def _venv_ready(venv: Path) -> bool:
    if not (venv / ".dynamod-vllm-stamp").is_file():
        return False
    site = list((venv / "lib").glob("python3*/site-packages"))
    if not site or not (site[0] / "vllm").is_dir():
        return False
    return any(site[0].glob("__editable__*dynamod*")) or any(site[0].glob("dynamod*.dist-info"))


def vllm_python() -> str | None:
    explicit = os.environ.get("DYN_VLLM_PYTHON")
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if _venv_ready(DEFAULT_VENV):
        return str(DEFAULT_VENV / "bin" / "python")
    return None


def vllm_marks(python: str | None) -> list[pytest.MarkDecorator]:
    """The marks of every live vLLM test module: the ``vllm`` marker, a timeout that allows for the
    engine's start, and a skip where no vLLM environment is installed."""
    return [
        pytest.mark.vllm,
        pytest.mark.timeout(900),
        pytest.mark.skipif(python is None, reason="no vLLM environment: run scripts/setup_vllm_env.sh"),
    ]


def build_tiny_model(out: Path, *, lora_out: Path | None = None) -> None:
    """The random-weight Llama (and a LoRA adapter for it), with our tokenizer."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_llama.py"), str(out)], check=True,
                   capture_output=True)
    if lora_out is not None:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_lora.py"), str(out), str(lora_out)],
                       check=True, capture_output=True)


def vllm_env(file_kv: Path, private: Path) -> dict[str, str]:
    env = clean_env(file_kv)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB of KV cache per engine on CPU
        HF_HUB_OFFLINE="1",
        VLLM_RPC_BASE_PATH=str(private),
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
    )
    return env


class VllmCluster:
    """A frontend and vLLM worker daemons as real processes on file discovery and ZMQ events."""

    def __init__(self, root: Path, python: str, model: Path, *, lease_ttl: float = 5.0) -> None:
        self.root = root
        self.python = python
        self.model = model
        self.file_kv = root / "discovery"
        self.file_kv.mkdir(parents=True, exist_ok=True)
        private = root / "vllm-ipc"
        private.mkdir(exist_ok=True)
        self.env = vllm_env(self.file_kv, private)
        self.lease_ttl = lease_ttl
        self.workers: list[Proc] = []
        self.frontend: Proc | None = None
        self.http_port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def runtime_flags(self) -> list[str]:
        return ["--discovery-backend", "file", "--event-plane", "zmq", "--file-kv", str(self.file_kv),
                "--lease-ttl", str(self.lease_ttl)]

    def start_worker(self, vllm_args: str, *, role: str = "agg") -> Proc:
        argv = [self.python, "-m", "dynamod.daemon.cli", "--role", role, "--engine", "vllm", "--model", str(self.model),
                "--vllm-args", vllm_args, *self.runtime_flags(), "--system-port", str(free_port())]
        proc = Proc(f"vllm-{role}-{len(self.workers) + 1}", argv, self.env, self.root)
        self.workers.append(proc)
        return proc

    def start_frontend(self, *extra: str) -> Proc:
        self.http_port = free_port()
        argv = [sys.executable, "-m", "dynamod.daemon.cli", "--role", "frontend", *self.runtime_flags(),
                "--http-port", str(self.http_port), "--worker-wait", "3", *extra]
        self.frontend = Proc("frontend", argv, clean_env(self.file_kv), self.root)
        return self.frontend

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        for proc in self.workers:
            proc.stop(timeout=60)
