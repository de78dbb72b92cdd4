"""``dynamod --role global-router`` end to end: two pools in their own namespaces (a fast and a
deliberately slow mocker worker, each behind its own ``--role router``), the global router in the
public namespace, and an ordinary frontend that finds it like any worker.

A user relies on: a short prompt with a relaxed (default) TTFT target landing in the slow pool; a
tight ``nvext.router.ttft_target``, a long prompt or a high ``nvext.agent_hints.priority`` landing
in the fast pool (counted by the pools' own workers); and, once the slow pool's worker has died, the
same request still answered, retried on the faster pool before its first token.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import CLI, LocalCluster, Proc, get_json, get_text
from tests.integration.router.test_router_role import RouterProc, metric_value
from tests.unit.global_router.grids import agg_grid

pytestmark = pytest.mark.timeout(120)

GRID = agg_grid(enable_priority_retry=True)  # short prompts: fast only with a TTFT target under 500 ms; long: fast
SHORT = [(7 * i + 3) % 4000 for i in range(64)]
LONG = [(11 * i + 5) % 4000 for i in range(700)]
WORKER_FLAGS = ("--block-size", "16", "--num-gpu-blocks", "1024")


class Pools:
    """The processes of the test and how to read them."""

    def __init__(self, root: Path) -> None:
        self.cluster = LocalCluster(root, lease_ttl=3.0)
        c = self.cluster
        self.fast_worker = c.start_worker(*WORKER_FLAGS, "--namespace", "fast", "--speedup-ratio", "20")
        self.slow_worker = c.start_worker(*WORKER_FLAGS, "--namespace", "slow", "--speedup-ratio", "1")
        self.routers = {ns: RouterProc(c, f"router-{ns}", "--namespace", ns, "--worker-wait", "1") for ns in ("fast", "slow")}
        config = root / "grid.json"
        config.write_text(json.dumps(GRID))
        self.gr_port = free_port()
        self.global_router = Proc(
            "global-router",
            [*CLI, "--role", "global-router", *c.runtime_flags(), "--config", str(config), "--system-port", str(self.gr_port)],
            c.env, c.root,
        )
        c.start_frontend()

    def worker_requests(self, worker: Proc) -> float:
        """``generate`` requests the worker received (its control endpoints count apart)."""
        port = self.cluster.worker_status_ports[worker.name]
        text = get_text(f"http://127.0.0.1:{port}/metrics")
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("dynamo_component_requests_total{") and 'endpoint="generate"' in line
        )

    def gr_metrics(self) -> str:
        return get_text(f"http://127.0.0.1:{self.gr_port}/metrics")

    def wait_ready(self) -> None:
        for router in self.routers.values():
            router.wait_ready(1)

        def pools_ready() -> bool:
            if not self.global_router.alive():
                raise AssertionError(f"global router exited:\n{self.global_router.log()}")
            try:
                pools = get_json(f"http://127.0.0.1:{self.gr_port}/health").get("pools", {})
            except OSError:
                return False
            return pools.get("fast", 0) >= 1 and pools.get("slow", 0) >= 1

        wait_until(pools_ready, 60, interval=0.1, what="global router sees both pool routers")
        self.cluster.wait_ready(1)  # the frontend serves "tiny" through the global router

    def complete(self, prompt: list[int], nvext: dict | None = None) -> dict:
        body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        if nvext is not None:
            body["nvext"] = nvext
        req = urllib.request.Request(
            self.cluster.url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stop(self) -> dict[str, int | None]:
        codes = {"global-router": self.global_router.stop()}
        for ns, router in self.routers.items():
            codes[f"router-{ns}"] = router.proc.stop()
        self.cluster.stop()
        return codes


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    p = Pools(tmp_path_factory.mktemp("global-router"))
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()


@pytest.mark.parametrize(
    ("prompt", "nvext", "pool"),
    [
        (SHORT, None, "slow"),  # short prompt, default TTFT target: the relaxed column
        (SHORT, {"router": {"ttft_target": 100}}, "fast"),  # a tight TTFT target
        (LONG, None, "fast"),  # a long prompt
        (SHORT, {"agent_hints": {"priority": 50}}, "fast"),  # a priority override
    ],
)
def test_requests_land_in_the_pool_their_length_targets_and_priority_select(
    pools: Pools, prompt: list[int], nvext: dict | None, pool: str
) -> None:
    workers = {"fast": pools.fast_worker, "slow": pools.slow_worker}
    before = {ns: pools.worker_requests(w) for ns, w in workers.items()}
    answer = pools.complete(prompt, nvext)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 4
    after = {ns: pools.worker_requests(w) for ns, w in workers.items()}
    other = "slow" if pool == "fast" else "fast"
    assert after[pool] == before[pool] + 1 and after[other] == before[other]


def test_a_pool_whose_worker_died_is_retried_on_the_faster_pool_before_the_first_token(pools: Pools) -> None:
    pools.slow_worker.kill9()
    slow_router = pools.routers["slow"]
    wait_until(lambda: (slow_router.health() or {}).get("workers") == 0, 30, interval=0.1, what="slow pool without workers")
    fast_before = pools.worker_requests(pools.fast_worker)
    answer = pools.complete(SHORT)  # the grid still picks the slow pool
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 4
    assert pools.worker_requests(pools.fast_worker) == fast_before + 1
    text = pools.gr_metrics()
    assert metric_value(text, 'dynamo_global_router_retries_total{from_pool="slow",stage="agg",to_pool="fast"}') == 1
    assert 'dynamo_global_router_selections_total{pool="fast",reason="priority_override",stage="agg"} 1.0' in text


def test_sigterm_leaves_discovery_and_exits_cleanly(pools: Pools) -> None:
    assert pools.global_router.stop() == 0, pools.global_router.log()
    # Its instance and card are withdrawn at once: the frontend drops the model well within a lease TTL.
    wait_until(lambda: not pools.cluster.ready_workers(), 2.0, interval=0.05, what="the frontend to drop the global router")
    assert "global router stopped" in pools.global_router.log()
