"""KV tiers end to end: a prefix evicted from a worker's device cache into its host tier brings the
next request for it back to that worker, which onboards the prefix instead of recomputing it.

Two mocker workers with a small device pool and a host tier, behind a KV-mode frontend. The
prompt goes to one worker; other prompts sent straight to that worker (``x-dynamo-worker-instance-
id``) push it out of its device cache into host memory. Sent again, the prompt has no device
overlap anywhere: without tier credit the idle, empty other worker would win the tie (smallest
cached tree). The frontend's ``x-dynamo-route-explain`` header must show the host-tier overlap it
credited, and the worker's tier metrics the onboarded blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.fixtures.servers import wait_until
from tests.integration.frontend.test_frontend_support import LocalCluster, get_text

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
DEVICE_BLOCKS = 24
HOST_BLOCKS = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("kv-tiers"))
    tiers = ("--block-size", str(BLOCK), "--num-gpu-blocks", str(DEVICE_BLOCKS), "--num-host-blocks", str(HOST_BLOCKS))
    try:
        c.start_worker(*tiers)
        c.start_worker(*tiers)
        c.start_frontend("--router-mode", "kv")
        c.wait_ready(2)
        # Both workers' (empty) caches re-read once the frontend's subscriptions settled: from then
        # on every KV event a worker publishes reaches the router.
        wait_until(lambda: _sum(get_text(c.url + "/metrics"), r'dynamo_router_kv_resyncs_total\{outcome="ok"\}') >= 4,
                   15, what="the frontend's settled kv_dump reads")
        yield c
    finally:
        c.stop()


def _sum(text: str, pattern: str) -> float:
    return sum(float(v) for v in re.findall(pattern + r" ([0-9.e+-]+)", text))


def _worker_metrics(c: LocalCluster, proc_name: str) -> str:
    return get_text(f"http://127.0.0.1:{c.worker_status_ports[proc_name]}/metrics")


def _worker_of(c: LocalCluster, instance_hex: str) -> str:
    """The process name of the worker serving ``instance_hex`` (its status server answers)."""
    for name, port in c.worker_status_ports.items():
        if f'worker_id="{instance_hex}"' in get_text(f"http://127.0.0.1:{port}/metrics"):
            return name
    raise AssertionError(f"no worker reports instance {instance_hex}")


def _tier_counter(c: LocalCluster, proc_name: str, name: str) -> float:
    """A worker's host-tier counter: ``offloaded`` or ``onboarded`` blocks, or ``hit_tokens``."""
    counter = "hit_tokens" if name == "hit_tokens" else f"{name}_blocks"
    return _sum(_worker_metrics(c, proc_name), rf'dynamo_component_kv_tier_{counter}_total\{{[^}}]*medium="CPU"[^}}]*\}}')


def _complete(client: httpx.Client, prompt: str, **headers: str) -> httpx.Response:
    resp = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True},
        headers=headers,
    )
    assert resp.status_code == 200, resp.text
    return resp


def _events_in_step(c: LocalCluster) -> bool:
    """Every KV event the workers published has reached the frontend's router."""
    published = sum(_sum(_worker_metrics(c, name), r"dynamo_component_kv_events_total\{[^}]*\}") for name in
                    c.worker_status_ports)
    received = _sum(get_text(c.url + "/metrics"), r"dynamo_router_kv_events_total\{[^}]*\}")
    return received >= published > 0


def test_prefix_in_host_memory_routes_back_and_is_onboarded(cluster: LocalCluster) -> None:
    prompt = "the document under study: " + " ".join(f"alpha{j}" for j in range(60))
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        first = _complete(client, prompt)
        owner = first.headers["x-dynamo-worker-instance-id"]
        prompt_blocks = first.json()["usage"]["prompt_tokens"] // BLOCK
        assert prompt_blocks >= 4, first.json()["usage"]
        owner_proc = _worker_of(cluster, owner)

        # Fill the owner's device pool with other prompts until the first is offloaded to its host tier.
        for i in range(4):
            filler = f"filler {i}: " + " ".join(f"beta{i}x{j}" for j in range(60))
            _complete(client, filler, **{"x-dynamo-worker-instance-id": owner})
        # The worker's tier counters follow its load reports (every few hundred ms): wait for them.
        wait_until(lambda: _tier_counter(cluster, owner_proc, "offloaded") >= prompt_blocks, 15,
                   what="the owner's device pool evicting the prompt into its host tier")
        wait_until(lambda: _events_in_step(cluster), 15, what="the router holding every published KV event")

        onboarded_before = _tier_counter(cluster, owner_proc, "onboarded")
        hits_before = _tier_counter(cluster, owner_proc, "hit_tokens")
        again = _complete(client, prompt, **{"x-dynamo-route-explain": "1"})

    assert again.headers["x-dynamo-worker-instance-id"] == owner
    explain = json.loads(again.headers["x-dynamo-route-explain"])
    assert int(explain["worker_id"], 16) == int(owner, 16)
    host = {int(c["worker_id"], 16): c.get("host_overlap_blocks", 0) for c in explain["candidates"]}
    # Every evicted block of the prompt is credited, not only its first: a host-tier chain reaches
    # the router whole (the router drops a stored block whose parent it cannot find).
    router_events = [line for line in get_text(cluster.url + "/metrics").splitlines() if "kv_events_total{" in line]
    assert host.get(int(owner, 16), 0) >= prompt_blocks - explain["overlap_blocks"] > 0, (explain, router_events)
    router = get_text(cluster.url + "/metrics")
    assert _sum(router, r'dynamo_router_tier_overlap_blocks_total\{medium="CPU"\}') > 0

    # The worker loaded the prefix from host memory instead of recomputing it.
    credited = host[int(owner, 16)]
    wait_until(lambda: _tier_counter(cluster, owner_proc, "onboarded") - onboarded_before >= credited, 15,
               what="the owner onboarding the credited blocks from its host tier")
    assert _tier_counter(cluster, owner_proc, "hit_tokens") - hits_before >= credited * BLOCK
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= credited * BLOCK
