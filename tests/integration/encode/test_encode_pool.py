"""The encode pool end to end: a frontend, an agg mocker worker serving ``tiny-vl`` and encode
workers (``dynamod --role encode``), as real processes, driven by the official ``openai`` client.

What a user relies on: an image prompt answers with the same ``prompt_tokens`` as without the
encode pool (the image's 64 tokens and its two markers); the encode worker did the encoding (its
metrics count the image, the agg worker's embedding cache counts the read, and the frontend says
the image went ``remote``); the same image again at the same place is a prefix-cache hit and is not
encoded at all, while the same image after other text is encoded again but its embedding is found
in the agg worker's cache (no read); and an encode worker killed while it encodes costs nothing
but time: the request completes through the other encode worker.
"""

from __future__ import annotations

import asyncio
import base64
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import openai
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.events.plane import TOPIC_KV_METRICS
from dynamod.shared.protocol.load import LoadMetrics, load_decoder
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_multimodal import (
    BLOCK,
    FOLLOW,
    IMAGE_TOKENS,
    MODEL,
    QUESTION,
    image_messages,
    png_url,
)
from tests.integration.frontend.test_frontend_support import CLI, LocalCluster, Proc, get_text

pytestmark = pytest.mark.timeout(90)


def start_encoder(c: LocalCluster, name: str, *extra: str) -> tuple[Proc, int]:
    port = free_port()
    argv = [*CLI, "--role", "encode", "--model", MODEL, *c.runtime_flags(), "--system-port", str(port),
            "--kv-transfer-backend", "tcp", "--shutdown-grace", "1", *extra]
    proc = Proc(name, argv, c.env, c.root)
    c.workers.append(proc)
    return proc, port


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def status_metrics(port: int) -> str:
    return get_text(f"http://127.0.0.1:{port}/metrics")


def encoders_ready(c: LocalCluster, n: int) -> bool:
    instances = c.health().get("instances", [])
    return sum(1 for i in instances if i.get("endpoint") == "encode" and i.get("status") == "ready") >= n


def chat(api: openai.OpenAI, messages: list[dict]) -> object:
    return api.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, int, list[int]]]:
    c = LocalCluster(tmp_path_factory.mktemp("encode-cluster"), speedup=50.0)
    try:
        c.start_worker("--model", MODEL, "--block-size", str(BLOCK), "--kv-transfer-backend", "tcp")
        # Encoder a is slow (2.5 s an image: time to kill it while it encodes), b is quick.
        enc_ports = [start_encoder(c, "encoder-a", "--encode-ms-per-image-token", "40")[1],
                     start_encoder(c, "encoder-b")[1]]
        c.start_frontend("--router-mode", "kv")
        c.wait_ready(1, model=MODEL)
        wait_until(lambda: encoders_ready(c, 2), 30, what="two ready encode workers")
        yield c, c.worker_status_ports[c.workers[0].name], enc_ports
    finally:
        c.stop()


@pytest.fixture()
def api(cluster: tuple[LocalCluster, int, list[int]]) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster[0].url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_encode_pool_encodes_and_caches(cluster: tuple[LocalCluster, int, list[int]], api: openai.OpenAI) -> None:
    c, worker_port, enc_ports = cluster
    text_only = chat(api, [{"role": "user", "content": QUESTION + FOLLOW}])
    first = chat(api, image_messages(png_url(11)))
    assert first.usage.prompt_tokens - text_only.usage.prompt_tokens == IMAGE_TOKENS + 2
    front = get_text(c.url + "/metrics")
    assert metric(front, "dynamo_frontend_encode_images_total", path="remote") == 1, front
    encoded = sum(metric(status_metrics(p), "dynamo_component_encoder_images_total") for p in enc_ports)
    assert encoded == 1
    assert sum(metric(status_metrics(p), "dynamo_component_encoder_image_tokens_total") for p in enc_ports) == IMAGE_TOKENS
    sent = len(base64.b64decode(png_url(11).split(",", 1)[1]))  # the PNG's bytes, as the client sent them
    assert sum(metric(status_metrics(p), "dynamo_component_encoder_image_bytes_total") for p in enc_ports) == sent
    work = status_metrics(worker_port)
    assert metric(work, "dynamo_component_embedding_cache_misses_total") == 1
    assert metric(work, "dynamo_component_embedding_transfer_failures_total") == 0
    assert metric(work, "dynamo_component_embedding_transfer_bytes_total") == IMAGE_TOKENS * 64 * 2

    # The same prompt again: its image's blocks are cached on the worker: nothing is encoded.
    again = chat(api, image_messages(png_url(11)))
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert metric(get_text(c.url + "/metrics"), "dynamo_frontend_encode_images_total", path="cached") == 1

    # The same image after other text: encoded again (its KV is not cached there), but the
    # embedding is in the worker's cache: no read.
    moved = image_messages(png_url(11))
    moved[0]["content"].insert(0, {"type": "text", "text": "Another preface changes every block before the image."})
    chat(api, moved)
    work = status_metrics(worker_port)
    assert metric(work, "dynamo_component_embedding_cache_hits_total") == 1
    assert metric(work, "dynamo_component_embedding_cache_misses_total") == 1


def encoder_record(c: LocalCluster, pid: int) -> dict:
    """The frontend's view of the ``encode`` record of the encode worker with process id ``pid``."""
    return next(i for i in c.health().get("instances", []) if i.get("endpoint") == "encode" and i.get("pid") == pid)


def dynamoctl(c: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """``dynamoctl`` as an operator runs it (its own process, the cluster's discovery)."""
    return subprocess.run([sys.executable, "-m", "dynamod.console.ctl.main", "--file-kv", str(c.file_kv), *args],
                          capture_output=True, text=True, timeout=30, env=c.env)


async def test_encoder_load_on_event_plane_and_drain(cluster: tuple[LocalCluster, int, list[int]], api: openai.OpenAI) -> None:
    """The load records the console reads: encode workers report encoder busy time and images/s,
    the agg worker its embedding cache. ``dynamoctl drain`` takes an encoder out of the pool (its
    images go to the other), ``dynamoctl sleep`` on it fails in one line, ``wake`` puts it back."""
    c, _, _ = cluster
    slow = c.workers[1]
    encoders = {int(i["instance_id"], 16) for i in c.health()["instances"] if i["endpoint"] == "encode"}
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="file", file_kv=str(c.file_kv), event_plane="zmq"))
    try:
        assert rt.events is not None
        sub = await rt.events.subscribe(rt.namespace().name, "*", TOPIC_KV_METRICS)
        sent = asyncio.create_task(asyncio.to_thread(chat, api, image_messages(png_url(31))))
        busy: LoadMetrics | None = None
        cache: LoadMetrics | None = None
        async with asyncio.timeout(15):
            async for msg in sub:
                m = load_decoder.decode(msg.payload)
                if m.worker_id in encoders and m.encode_images_per_s > 0:
                    busy = m
                elif m.worker_id not in encoders and m.embedding_cache_misses >= 1:
                    cache = m
                if busy is not None and cache is not None and sent.done():
                    break
        await sent
        await sub.close()
    finally:
        await rt.shutdown(grace_s=0.5)
    assert busy is not None and 0 < busy.encoder_busy <= 1 and busy.kv_usage == 0 and busy.status == "ready"
    assert cache is not None and cache.total_blocks > 0  # the agg worker's own record, the cache riding along

    slow_id = encoder_record(c, slow.popen.pid)["instance_id"]
    drained = dynamoctl(c, "drain", slow_id, "--wait", "--drain-timeout", "10")
    assert drained.returncode == 0 and "drained" in drained.stdout, drained.stderr
    wait_until(lambda: encoder_record(c, slow.popen.pid)["status"] == "draining", 10, what="the frontend sees it draining")
    before = metric(status_metrics(cluster[2][0]), "dynamo_component_encoder_images_total")
    for seed in (32, 33):  # the pool would alternate: both go to the other encoder
        chat(api, image_messages(png_url(seed)))
    assert metric(status_metrics(cluster[2][0]), "dynamo_component_encoder_images_total") == before
    slept = dynamoctl(c, "sleep", slow_id)
    assert slept.returncode != 0 and slept.stdout == ""
    assert slept.stderr.strip().splitlines() == [
        f"dynamoctl: error: sleep {slow_id}: sleep is not supported on an encode worker (it holds no KV, engine or adapters)"]
    woke = dynamoctl(c, "wake", slow_id)
    assert woke.returncode == 0, woke.stderr
    wait_until(lambda: encoder_record(c, slow.popen.pid)["status"] == "ready", 10, what="the encoder ready again")


def test_encoder_killed_mid_request(cluster: tuple[LocalCluster, int, list[int]], api: openai.OpenAI) -> None:
    c, _, enc_ports = cluster
    slow = c.workers[1]
    results: list[object] = []
    errors: list[BaseException] = []

    def send(seed: int) -> None:
        try:
            results.append(chat(api, image_messages(png_url(seed))))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    # Two requests at once: the pool spreads them, so one lands on the slow encoder.
    threads = [threading.Thread(target=send, args=(seed,)) for seed in (21, 22)]
    for t in threads:
        t.start()
    wait_until(lambda: metric(status_metrics(enc_ports[0]), "dynamo_component_encoder_inflight_images") >= 1, 10,
               what="an image on the slow encoder")
    slow.popen.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(results) == 2 and len({r.usage.prompt_tokens for r in results}) == 1
    front = get_text(c.url + "/metrics")
    assert metric(front, "dynamo_frontend_encode_failures_total") >= 1
    assert metric(front, "dynamo_frontend_encode_images_total", path="fallback") == 0
    assert re.search(r"dynamo_component_encoder_images_total\{[^}]*\} [2-9]", status_metrics(enc_ports[1]))


def test_without_encoders_the_worker_encodes(cluster: tuple[LocalCluster, int, list[int]], api: openai.OpenAI) -> None:
    c, _, _ = cluster
    c.workers[2].popen.send_signal(signal.SIGKILL)  # encoder b; a was killed above (or now, run alone)
    c.workers[1].popen.send_signal(signal.SIGKILL)
    before = get_text(c.url + "/metrics")
    answer = chat(api, image_messages(png_url(41)))
    assert answer.usage.prompt_tokens > IMAGE_TOKENS and answer.choices[0].finish_reason == "length"
    after = get_text(c.url + "/metrics")
    # The dead encoders' records may still be there (their lease runs out): tried, then local.
    moved = sum(metric(after, "dynamo_frontend_encode_images_total", path=p) - metric(before, "dynamo_frontend_encode_images_total", path=p)
                for p in ("fallback", "local"))
    assert moved == 1
