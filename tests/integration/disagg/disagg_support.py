"""Support for the disaggregated-serving end-to-end tests (no tests here): a frontend, prefill and
decode mocker workers as real processes on file discovery and ZMQ events, loopback ports chosen at
run time, and readers for the figures the tests compare (worker Prometheus metrics, the frontend's
route explanations)."""

from __future__ import annotations

import json
import re
import urllib.error
from pathlib import Path

from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import CLI, LocalCluster, Proc, get_json, get_text


class DisaggCluster(LocalCluster):
    """``LocalCluster`` with roles: ``start_role_worker("prefill" | "decode" | "agg")``."""

    def __init__(self, root: Path, **kwargs: object) -> None:
        super().__init__(root, **kwargs)  # type: ignore[arg-type]
        self.roles: dict[str, str] = {}

    def start_role_worker(self, role: str, *extra: str) -> Proc:
        self._count += 1
        port = free_port()
        argv = [*CLI, "--role", role, "--engine", "mocker", "--model", "tiny", *self.runtime_flags(),
                "--speedup-ratio", str(self.speedup), "--system-port", str(port), *extra]
        proc = Proc(f"{role}-{self._count}", argv, self.env, self.root)
        self.worker_status_ports[proc.name] = port
        self.roles[proc.name] = role
        self.workers.append(proc)
        return proc

    def by_role(self, role: str) -> list[Proc]:
        return [p for p in self.workers if self.roles.get(p.name) == role and p.alive()]

    def model_entry(self, model: str = "tiny") -> dict:
        try:
            body = self.health()
        except (urllib.error.URLError, OSError, ValueError):
            return {}
        for m in body.get("models", []):
            if m["model"] == model:
                return m
        return {}

    def wait_pools(self, prefill: int, decode: int, model: str = "tiny", timeout: float = 60.0) -> dict:
        """Until the frontend sees ``decode`` ready decode workers and ``prefill`` ready prefill ones."""

        def check() -> dict | None:
            for proc in self.workers:
                if not proc.alive() and proc.popen.returncode not in (None, -9):
                    raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
            entry = self.model_entry(model)
            ready = sum(1 for w in entry.get("workers", []) if w.get("status") == "ready")
            if ready >= decode and int(entry.get("prefill_ready", 0)) >= prefill:
                return entry
            return None

        return wait_until(check, timeout, interval=0.1, what=f"{prefill} prefill + {decode} decode workers")

    def metrics(self, proc: Proc) -> str:
        return get_text(f"http://127.0.0.1:{self.worker_status_ports[proc.name]}/metrics")

    def frontend_metrics(self) -> str:
        return get_text(self.url + "/metrics")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels`` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$", line)
        if m is None or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def explain(headers: object) -> dict:
    """The parsed ``x-dynamo-route-explain`` header of a response."""
    value = headers.get("x-dynamo-route-explain")  # type: ignore[attr-defined]
    assert value, "no x-dynamo-route-explain header"
    return json.loads(value)


__all__ = ["DisaggCluster", "explain", "get_json", "metric_sum"]
