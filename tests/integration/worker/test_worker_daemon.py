"""The node daemon (`dynamod --role agg --engine mocker`) as a real process, driven over the real
request plane and observed through real discovery and ZMQ events."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.errors import InvalidRequestError, UnavailableError
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.keys import mdc_key, mdc_prefix
from dynamod.shared.protocol.kv_events import KvCleared, KvStored, router_event_decoder
from dynamod.shared.protocol.llm import EngineOutput, PreprocessedRequest, StopConditions
from dynamod.shared.protocol.model_card import decode_card
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.daemons import DaemonProcess, file_cluster_env
from tests.fixtures.lora import make_adapter

BLOCK = 16
TTL = 2.0


def _mocker_daemon(tmp_path: Path, env: dict[str, str], *flags: str) -> DaemonProcess:
    """A mocker node daemon serving ``tiny`` fast, in ``BLOCK``-token blocks, logging into ``tmp_path``."""
    return DaemonProcess(
        ["--role", "agg", "--engine", "mocker", "--model", "tiny", "--speedup-ratio", "20", "--block-size", str(BLOCK), *flags],
        env=env, log_dir=str(tmp_path),
    )


def _file_settings(kv_dir: Path) -> RuntimeSettings:
    """The in-test runtime's view of the daemon's file discovery directory."""
    return RuntimeSettings(discovery_backend="file", file_kv=str(kv_dir), event_plane="zmq", lease_ttl_s=TTL)


@pytest.fixture
async def cluster(tmp_path):
    """One worker daemon process plus an in-test runtime on the same file discovery directory."""
    kv_dir = tmp_path / "kv"
    make_adapter(tmp_path / "adapters", "pirate")
    env = file_cluster_env(kv_dir, DYN_LEASE_TTL=str(TTL), DYN_LORA_ROOT=str(tmp_path / "adapters"))
    worker = _mocker_daemon(tmp_path, env, "--num-gpu-blocks", "256", "--system-port", "0")
    rt = await DistributedRuntime.create(_file_settings(kv_dir))
    try:
        comp = rt.namespace().component("backend")
        generate = await comp.endpoint("generate").client()
        [inst] = await wait_registered(generate, worker)
        yield rt, comp, generate, inst, worker
    finally:
        worker.kill()
        await rt.shutdown(1)


async def wait_registered(client, daemon: DaemonProcess, count: int = 1, timeout: float = 30.0):
    """Waits for the daemon's instances, failing at once (with its log) if the process dies."""
    async with asyncio.timeout(timeout):
        while True:
            if not daemon.alive():
                raise AssertionError(f"daemon exited with {daemon.proc.returncode}; log:\n{daemon.log()}")
            try:
                return await client.wait_for_instances(count, timeout=0.2)
            except TimeoutError:
                continue


def request(rid: str, tokens: list[int], max_tokens: int = 8) -> dict:
    req = PreprocessedRequest(request_id=rid, model="tiny", token_ids=tokens,
                              stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))
    return msgspec.to_builtins(req)


async def connected_subscription(comp, generate, inst):
    """A kv-events subscription that has provably received an event from the worker.

    ZMQ subscribers connect asynchronously after they discover a publisher (the slow-joiner
    window), so the test warms up with throwaway prompts until one of their events arrives.
    """
    sub = await comp.subscribe("kv-events")
    it = sub.__aiter__()
    for attempt in range(50):
        await run_generate(generate, inst, request(f"warm{attempt}", [3000 + attempt] * BLOCK))
        try:
            async with asyncio.timeout(0.3):
                await anext(it)
            break
        except TimeoutError:
            continue
    else:
        raise AssertionError("no kv event arrived from the worker")
    while True:  # drain the rest of the warm-up events
        try:
            async with asyncio.timeout(0.2):
                await anext(it)
        except TimeoutError:
            break
    return sub, it


async def run_generate(client, inst, body) -> list[EngineOutput]:
    return [msgspec.convert(o, EngineOutput) async for o in client.stream_to(inst, body)]


async def control(comp, name: str, inst_id: int, body: dict | None = None) -> dict:
    client = await comp.endpoint(name).client()
    try:
        await client.wait_for_instances(1, timeout=10, routable=False)
        replies = await client.call(body or {}, instance_id=inst_id)
        return replies[-1]
    finally:
        await client.close()


async def test_generate_reuses_prefix_and_events_match_router_hashing(cluster) -> None:
    rt, comp, generate, inst, _ = cluster
    sub, events = await connected_subscription(comp, generate, inst)
    prompt = list(range(100, 100 + 5 * BLOCK + 3))  # five full blocks and a partial tail
    first = await run_generate(generate, inst, request("a", prompt))
    assert sum(len(o.token_ids) for o in first) == 8
    assert first[-1].finish_reason == "length" and first[-1].usage.cached_tokens == 0
    second = await run_generate(generate, inst, request("b", prompt))
    assert second[-1].usage.prompt_tokens == len(prompt)
    assert second[-1].usage.cached_tokens == 5 * BLOCK

    local, seq = hash_tokens(prompt, BLOCK)
    stored: list = []
    async with asyncio.timeout(10):
        while True:
            ev = router_event_decoder.decode((await anext(events)).payload)
            assert ev.worker_id == inst.instance_id
            if isinstance(ev.event, KvStored):
                stored.extend(ev.event.blocks)
            if len(stored) >= 5:
                break
    await sub.close()
    assert [b.tokens_hash for b in stored[:5]] == local
    assert [b.block_hash for b in stored[:5]] == seq


async def test_model_card_published(cluster) -> None:
    rt, _, _, inst, _ = cluster
    cards = await rt.store.get_prefix(mdc_prefix("dynamo"))
    [raw] = [v for k, v in cards.items() if k == mdc_key("dynamo", "backend", "generate", inst.instance_id)]
    card = decode_card(raw)
    assert card.served_model_name == "tiny" and card.kv_block_size == BLOCK
    assert card.runtime_config.total_kv_blocks == 256 and card.context_length > 0


async def test_drain_finishes_inflight_then_refuses(cluster) -> None:
    rt, comp, generate, inst, _ = cluster
    stream = generate.stream_to(inst, request("long", list(range(40)), max_tokens=200))
    first = msgspec.convert(await anext(stream), EngineOutput)  # the worker has admitted it

    async def rest() -> list[EngineOutput]:
        return [msgspec.convert(o, EngineOutput) async for o in stream]

    remaining = asyncio.create_task(rest())
    reply = await control(comp, "drain", inst.instance_id, {"wait": True, "timeout_s": 30})
    assert reply["status"] == "ok" and reply["message"] == "drained"
    outs = [first, *await remaining]
    assert sum(len(o.token_ids) for o in outs) == 200  # the admitted request finished completely
    await generate.instance_set.wait_for(lambda xs: xs and xs[0].status == "draining", 5)
    with pytest.raises(UnavailableError):
        await run_generate(generate, inst, request("late", [1, 2, 3]))


async def test_sleep_and_wake(cluster) -> None:
    rt, comp, generate, inst, _ = cluster
    reply = await control(comp, "sleep", inst.instance_id, {"level": 1})
    assert reply["status"] == "ok"
    await generate.instance_set.wait_for(lambda xs: xs and xs[0].status == "sleeping", 5)
    assert generate.routable == []
    with pytest.raises(UnavailableError):
        await run_generate(generate, inst, request("zz", [1, 2, 3]))
    reply = await control(comp, "wake_up", inst.instance_id)
    assert reply["status"] == "ok"
    await generate.instance_set.wait_for(lambda xs: xs and xs[0].status == "ready", 5)
    outs = await run_generate(generate, inst, request("after", [1, 2, 3]))
    assert sum(len(o.token_ids) for o in outs) == 8


async def test_lora_load_list_unload(cluster, tmp_path) -> None:
    rt, comp, generate, inst, _ = cluster
    source = f"file://{tmp_path}/adapters/pirate"
    reply = await control(comp, "load_lora", inst.instance_id, {"lora_name": "pirate", "source": {"uri": source}})
    assert reply["status"] == "ok"
    key = mdc_key("dynamo", "backend", "generate", inst.instance_id, "pirate")
    card = decode_card(await rt.store.get(key))
    assert card.lora == "pirate" and card.base_model == "tiny"
    listed = await control(comp, "list_loras", inst.instance_id)
    assert [lo["name"] for lo in listed["loras"]] == ["pirate"]
    body = request("l1", list(range(3 * BLOCK)))
    body["lora_name"] = "pirate"
    outs = await run_generate(generate, inst, body)
    assert outs[-1].finish_reason == "length"
    assert (await control(comp, "unload_lora", inst.instance_id, {"lora_name": "pirate"}))["status"] == "ok"
    assert await rt.store.get(key) is None
    with pytest.raises(InvalidRequestError):
        await run_generate(generate, inst, body)


async def test_clear_kv_blocks_emits_cleared_and_drops_cache(cluster) -> None:
    rt, comp, generate, inst, _ = cluster
    prompt = list(range(4 * BLOCK + 1))
    await run_generate(generate, inst, request("x", prompt))
    sub, events = await connected_subscription(comp, generate, inst)
    reply = await control(comp, "clear_kv_blocks", inst.instance_id)
    assert reply["status"] == "ok" and reply["cleared_blocks"] >= 4
    async with asyncio.timeout(10):
        while not isinstance(router_event_decoder.decode((await anext(events)).payload).event, KvCleared):
            pass
    await sub.close()
    outs = await run_generate(generate, inst, request("y", prompt))
    assert outs[-1].usage.cached_tokens == 0


async def test_bad_control_bodies_get_errors_and_worker_keeps_serving(cluster) -> None:
    rt, comp, generate, inst, worker = cluster
    for name, body in [("sleep", {"level": "deep"}), ("sleep", {"level": 7}), ("load_lora", {"source": 3}),
                       ("unload_lora", {}), ("drain", {"wait": "maybe"})]:
        client = await comp.endpoint(name).client()
        await client.wait_for_instances(1, timeout=10, routable=False)
        with pytest.raises(InvalidRequestError):
            await client.call(body, instance_id=inst.instance_id)
        await client.close()
    with pytest.raises(InvalidRequestError):
        await run_generate(generate, inst, {"request_id": "bad", "token_ids": "not tokens"})
    assert worker.alive()
    outs = await run_generate(generate, inst, request("ok", [5, 6, 7]))
    assert sum(len(o.token_ids) for o in outs) == 8


async def test_killed_daemon_leaves_within_lease_ttl(cluster) -> None:
    rt, comp, generate, inst, worker = cluster
    worker.kill()
    loop = asyncio.get_running_loop()
    start = loop.time()
    await generate.instance_set.wait_for(lambda xs: not xs, timeout=TTL + 3)
    assert loop.time() - start <= TTL + 2.5


async def test_sigterm_deregisters_and_exits_zero(cluster) -> None:
    rt, comp, generate, inst, worker = cluster
    code = await asyncio.to_thread(worker.terminate, 30)
    assert code == 0, worker.log()
    await generate.instance_set.wait_for(lambda xs: not xs, timeout=1)
    assert await rt.store.get(mdc_key("dynamo", "backend", "generate", inst.instance_id)) is None


async def test_num_workers_runs_separate_instances_in_one_process(tmp_path) -> None:
    kv_dir = tmp_path / "kv2"
    env = file_cluster_env(kv_dir, DYN_LEASE_TTL=str(TTL))
    daemon = _mocker_daemon(tmp_path, env, "--num-gpu-blocks", "128", "--num-workers", "3")
    rt = await DistributedRuntime.create(_file_settings(kv_dir))
    try:
        generate = await rt.namespace().component("backend").endpoint("generate").client()
        insts = await wait_registered(generate, daemon, count=3)
        assert len({i.instance_id for i in insts}) == 3 and len({i.pid for i in insts}) == 1
        for n, inst in enumerate(insts):  # each engine serves on its own, with its own cache
            prompt = list(range(200, 200 + 2 * BLOCK))
            first = await run_generate(generate, inst, request(f"n{n}a", prompt))
            again = await run_generate(generate, inst, request(f"n{n}b", prompt))
            assert first[-1].usage.cached_tokens == 0 and again[-1].usage.cached_tokens == BLOCK
    finally:
        daemon.kill()
        await rt.shutdown(1)
