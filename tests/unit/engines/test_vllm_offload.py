"""vLLM's host KV tier through the adapter: the connector config it builds, the offloading
connector's events as router tiers (index, dump, cost credit), ``clear_kv_blocks`` per tier, and
the advertised host of the NIXL side channel.

The CPU build of vLLM refuses its offloading worker (offload.py), so no engine runs here: the
events are built field for field as vLLM 0.32's ``OffloadingEventsTracker`` emits them
(distributed/kv_transfer/kv_connector/v1/offloading/events.py), and ``reset_prefix_cache`` is a
stand-in recording its arguments. With the vLLM environment installed, the config is also checked
against vLLM's own ``KVTransferConfig`` and connector factory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from dynamod.daemon.engines.base import EngineState
from dynamod.daemon.engines.common.native_kv import NativeKvEventQueue
from dynamod.daemon.engines.vllm import adapter, disagg, offload
from dynamod.daemon.engines.vllm.engine import VllmEngine
from dynamod.daemon.models.kv_layout import KvGeometry
from dynamod.daemon.models.local import load_model_dir
from dynamod.daemon.router.core.config import KvRouterConfig
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.shared.errors import ConfigError, InvalidRequestError, UnavailableError
from dynamod.shared.kv.hashing import compute_block_hashes
from dynamod.shared.kv.indexer import KvIndexer
from dynamod.shared.protocol.kv_events import KvCleared, decode_native_batch
from tests.integration.engines.test_vllm_support import build_tiny_model, vllm_python

ROOT = Path(__file__).resolve().parents[3]
BS = 16
W1, W2 = 0xA1, 0xB2
# The tiny model's shape (scripts/make_tiny_llama.py): 2 layers, 1 KV head of 32, float32 on disk.
TINY = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=32, dtype_bytes=4)


# ---- the connector config -------------------------------------------------------------------------


def test_host_blocks_become_vllms_bytes_at_its_cache_dtype() -> None:
    # auto dtype: vLLM downcasts a float32 checkpoint to 16 bits -> 2 x 1 x 32 x 2 layers x 2 B = 256 B/token.
    assert offload.host_tier_request([], 10, 64, TINY) == 10 * 256 * 64
    assert offload.host_tier_request(["--dtype", "float32"], 10, 64, TINY) == 10 * 512 * 64
    assert offload.host_tier_request(["--kv-cache-dtype", "fp8_e4m3"], 10, 64, TINY) == 10 * 128 * 64
    # vLLM rounds each offloaded block up to the page size: an 8-token block of 2 KiB takes a page.
    assert offload.host_tier_request([], 3, 8, TINY) == 3 * offload.PAGE_ALIGNMENT
    assert offload.host_tier_request([], 0, 64, TINY) is None


def test_vllms_own_offloading_size_is_taken_over_and_other_backends_left_alone() -> None:
    tokens = ["--enforce-eager", "--kv-offloading-size", "1.5", "--kv-offloading-backend", "native"]
    assert offload.host_tier_request(tokens, 0, 64, None) == int(1.5 * (1 << 30))
    assert offload.without_offloading_flags(tokens) == ["--enforce-eager"]
    lmcache = ["--kv-offloading-size", "4", "--kv-offloading-backend", "lmcache"]
    assert offload.host_tier_request(lmcache, 0, 64, TINY) is None
    assert offload.without_offloading_flags(lmcache) == lmcache


@pytest.mark.parametrize(
    ("tokens", "blocks", "geometry", "message"),
    [
        (["--kv-offloading-size", "1"], 8, TINY, "give the host KV tier once"),
        (["--kv-offloading-size", "lots"], 0, TINY, "must be a number of GiB"),
        (["--kv-offloading-size", "0"], 0, TINY, "above 0 GiB"),
        ([], -1, TINY, ">= 0"),
        ([], 8, None, "KV geometry"),
        (["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"], 8, TINY, "native offloading"),
    ],
)
def test_bad_host_tier_requests_say_what_to_change(tokens, blocks, geometry, message) -> None:
    with pytest.raises(ConfigError, match=message):
        offload.host_tier_request(tokens, blocks, 64, geometry)


def test_connector_per_role_with_and_without_the_host_tier() -> None:
    host = offload.kv_transfer_config("agg", [], 4096)
    assert host == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 4096, "self_describing_kv_events": True},
    }
    assert offload.kv_transfer_config("agg", [], None) is None
    both = offload.kv_transfer_config("prefill", [], 4096)
    assert both is not None and both["kv_connector"] == "MultiConnector"
    children = both["kv_connector_extra_config"]["connectors"]
    # NIXL first: it claims a decode leg's remote blocks before the host tier is asked.
    assert [c["kv_connector"] for c in children] == [disagg.DEFAULT_CONNECTOR, "OffloadingConnector"]
    assert offload.kv_transfer_config("decode", [], None) == children[0]
    with pytest.raises(ConfigError, match="replaces the connectors"):
        offload.kv_transfer_config("agg", ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1"}'], 4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    build_tiny_model(out)
    return load_model_dir(out)


def _args(**kw) -> argparse.Namespace:
    base = {"vllm_args": "--block-size 16 --enforce-eager", "engine_args": None, "role": "agg", "num_host_blocks": 0,
            "host": None, "advertise_host": None}
    base.update(kw)
    return argparse.Namespace(**base)


def test_adapter_builds_the_engine_with_the_host_tier_in_its_argv(tiny) -> None:
    engine = adapter.create(_args(num_host_blocks=32, role="prefill"), tiny, worker_id=7)
    assert engine.host_tier
    cfg = engine._kv_transfer  # noqa: SLF001 - what start() hands vLLM
    assert cfg is not None and cfg["kv_connector"] == "MultiConnector"
    offloading = cfg["kv_connector_extra_config"]["connectors"][1]
    assert offloading["kv_connector_extra_config"]["cpu_bytes_to_use"] == 32 * 256 * BS
    plain = adapter.create(_args(vllm_args="--block-size 16 --kv-offloading-size 0.5"), tiny, worker_id=8)
    assert plain.host_tier and "--kv-offloading-size" not in plain._tokens  # noqa: SLF001
    assert not adapter.create(_args(), tiny, worker_id=9).host_tier


def test_the_config_is_vllms_own(tmp_path: Path) -> None:
    """vLLM's ``KVTransferConfig`` takes the combined config and its factory finds every child."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM environment: run scripts/setup_vllm_env.sh")
    cfg = offload.kv_transfer_config("prefill", [], 1 << 20)
    script = (
        "import json, sys\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "cfg = KVTransferConfig(**json.loads(sys.argv[1]))\n"
        "names = [KVConnectorFactory.get_connector_class(cfg).__name__]\n"
        "for child in cfg.kv_connector_extra_config['connectors']:\n"
        "    names.append(KVConnectorFactory.get_connector_class(KVTransferConfig(**child)).__name__)\n"
        "print(json.dumps(names))\n"
    )
    out = subprocess.run([python, "-c", script, json.dumps(cfg)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    multi, nixl, offloading = json.loads(out.stdout.strip().splitlines()[-1])
    # vLLM 0.32 registers "NixlConnector" as its pull-mode NIXL class.
    assert (multi, offloading) == ("MultiConnector", "OffloadingConnector") and nixl.startswith("Nixl")


def test_cpu_build_refuses_the_host_tier_in_one_line() -> None:
    """What ran here: vLLM 0.32's CPU build raises in ``CPUOffloadingSpec.get_worker`` when the
    engine sizes its cache; the adapter says so before building the engine."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM environment: run scripts/setup_vllm_env.sh")
    script = (
        # This checkout's code, whichever checkout the vLLM venv has installed editable.
        f"import dynamod; dynamod.__path__.insert(0, {str(ROOT)!r})\n"
        "from vllm.platforms import current_platform\n"
        "from dynamod.daemon.engines.vllm.offload import check_platform\n"
        "from dynamod.shared.errors import ConfigError\n"
        "try:\n    check_platform()\nexcept ConfigError as exc:\n    print('refused', exc)\nelse:\n    print('ok')\n"
        "print(current_platform.device_type)\n"
    )
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    verdict, device = out.stdout.strip().splitlines()[-2:]
    if device in ("cuda", "xpu"):
        assert verdict == "ok"
    else:
        assert verdict.startswith("refused vLLM's KV offloading to host memory runs on CUDA, ROCm and XPU only")


# ---- the offloading connector's events as router tiers --------------------------------------------


def _gpu_stored(hashes, parent, tokens) -> dict:
    """A device ``BlockStored`` as vLLM 0.32's block pool publishes it."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None] * len(hashes),
            "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def _cpu_stored(block_hash, parent, tokens) -> dict:
    """One offloaded chunk (one block per chunk) as ``OffloadingEventsTracker._take_stored_event``
    publishes it with self-describing events: its own parent, tokens and block size; vLLM omits
    the None-valued ``locality``/``ownership``/``kv_cache_spec_sliding_window``."""
    return {"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "CPU", "lora_name": None, "extra_keys": None,
            "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def _placeholder(block_hash) -> dict:
    """The same store without self-describing events: no tokens, block size 0."""
    return {"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0}


def _batch(events: list[dict]) -> bytes:
    return msgspec.msgpack.encode([1_700_000_000.0, events, 0])


PROMPT = list(range(100, 100 + 4 * BS))
ENGINE = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32, b"\x04" * 32]  # vLLM's sha256 block hashes


def _offloaded_then_evicted() -> list[bytes]:
    """The prompt computed on the device, its four blocks offloaded to host memory, then blocks
    2-4 evicted from the device by other prompts; then the device cache reset."""
    chunks = [PROMPT[i * BS : (i + 1) * BS] for i in range(4)]
    return [
        _batch([_gpu_stored(ENGINE, None, PROMPT)]),
        _batch([_cpu_stored(ENGINE[i], ENGINE[i - 1] if i else None, chunks[i]) for i in range(4)]
               + [_placeholder(b"\x09" * 32)]),
        _batch([{"type": "BlockRemoved", "block_hashes": ENGINE[1:], "medium": "GPU", "group_idx": 0}]),
    ]


def _feed(worker: int) -> tuple[NativeKvEventQueue, list]:
    feed = NativeKvEventQueue(worker, cleared_medium="GPU")
    out = []
    for payload in _offloaded_then_evicted():
        feed.on_batch(0, decode_native_batch(payload))
    while not feed._queue.empty():  # noqa: SLF001 - what the daemon would publish
        out.append(feed._queue.get_nowait())
    return feed, out


def test_offloaded_blocks_reach_the_router_index_as_the_host_tier() -> None:
    feed, events = _feed(W1)
    assert [(type(e.event).__name__, e.event.medium) for e in events] == [
        ("KvStored", "GPU"), *[("KvStored", "CPU")] * 4, ("KvRemoved", "GPU")
    ]  # the placeholder (no tokens) is dropped
    local = compute_block_hashes(PROMPT, BS)
    index = KvIndexer()
    index.apply_events(events)
    matches = index.find_matches(local)
    assert matches.by_medium((W1, 0)) == {"GPU": 1, "CPU": 3, "DISK": 0}
    assert index.tier_sizes((W1, 0)) == {"GPU": 1, "CPU": 4, "DISK": 0}

    # The worker's dump rebuilds the same tiers in a router that missed everything.
    assert feed.table.num_blocks() == 1 and feed.table.num_blocks(medium="CPU") == 4
    rebuilt = KvIndexer()
    assert rebuilt.apply_events(feed.dump()) == 0
    assert rebuilt.tier_sizes((W1, 0)) == index.tier_sizes((W1, 0))

    # vLLM's own AllBlocksCleared comes from its device pool: the host copies stay indexed.
    feed.on_batch(0, decode_native_batch(_batch([{"type": "AllBlocksCleared"}])))
    cleared = feed._queue.get_nowait()  # noqa: SLF001
    assert cleared.event == KvCleared(medium="GPU")
    index.apply_event(cleared)
    assert index.tier_sizes((W1, 0)) == {"GPU": 0, "CPU": 4, "DISK": 0}
    assert feed.table.num_blocks() == 0 and feed.table.num_blocks(medium="CPU") == 4


def test_host_tier_credit_wins_the_route() -> None:
    """W1 holds the prompt's first block on the device and the rest in host memory; W2 holds two
    blocks on the device. Credited at 0.75 a host block, W1 is cheaper; without its host tier W2 is."""
    _, events = _feed(W1)
    other = NativeKvEventQueue(W2)
    other.on_batch(0, decode_native_batch(_batch([_gpu_stored(ENGINE[:2], None, PROMPT[: 2 * BS])])))
    w2_events = [other._queue.get_nowait()]  # noqa: SLF001

    def route(with_host: bool):
        router = KvRouter(KvRouterConfig(), BS)
        router.update_workers([(W1, 0), (W2, 0)])
        router.apply_events([e for e in events if with_host or e.event.medium == "GPU"])
        router.apply_events(w2_events)
        return router.best_worker("r", PROMPT)

    decision = route(with_host=True)
    assert decision.worker_id == W1
    winner = decision.winner
    assert (winner.overlap_blocks, winner.host_overlap_blocks) == (1, 3)
    assert winner.tier_credit_blocks == pytest.approx(0.75 * 3)
    assert route(with_host=False).worker_id == W2


# ---- clear_kv_blocks per tier -------------------------------------------------------------------


class _ResettingLlm:
    """Stands in for ``AsyncLLM.reset_prefix_cache`` (the offloading worker cannot run here)."""

    def __init__(self, succeed: bool = True) -> None:
        self.calls: list[dict] = []
        self.succeed = succeed

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append({"reset_running_requests": reset_running_requests, "reset_connector": reset_connector})
        return self.succeed


def _running(tiny, host_bytes: int | None, llm: _ResettingLlm) -> VllmEngine:
    engine = VllmEngine(["--block-size", str(BS)], tiny, W1, host_tier_bytes=host_bytes)
    for payload in _offloaded_then_evicted():
        engine.kv_feed.on_batch(0, decode_native_batch(payload))
    while not engine.kv_feed._queue.empty():  # noqa: SLF001
        engine.kv_feed._queue.get_nowait()  # noqa: SLF001
    engine._llm = llm  # noqa: SLF001 - a started engine
    engine._status = EngineState.READY  # noqa: SLF001
    return engine


async def test_clearing_every_tier_resets_the_connector_too(tiny) -> None:
    llm = _ResettingLlm()
    engine = _running(tiny, 1 << 20, llm)
    assert await engine.clear_kv_blocks() == 1 + 4
    assert llm.calls == [{"reset_running_requests": False, "reset_connector": True}]
    assert engine.kv_feed._queue.get_nowait().event == KvCleared(medium=None)  # noqa: SLF001
    assert engine.kv_feed.table.num_blocks(medium="CPU") == 0


async def test_clearing_the_device_keeps_the_host_tier(tiny) -> None:
    llm = _ResettingLlm()
    engine = _running(tiny, 1 << 20, llm)
    assert await engine.clear_kv_blocks("GPU") == 1
    assert llm.calls == [{"reset_running_requests": False, "reset_connector": False}]
    assert engine.kv_feed._queue.get_nowait().event == KvCleared(medium="GPU")  # noqa: SLF001
    assert engine.kv_feed.table.num_blocks(medium="CPU") == 4


async def test_tiers_vllm_cannot_clear_alone_are_refused(tiny) -> None:
    llm = _ResettingLlm()
    engine = _running(tiny, 1 << 20, llm)
    with pytest.raises(InvalidRequestError, match="only together with its device cache"):
        await engine.clear_kv_blocks("CPU")
    with pytest.raises(InvalidRequestError, match="keeps no DISK KV tier"):
        await engine.clear_kv_blocks("DISK")
    without = _running(tiny, None, llm)
    with pytest.raises(InvalidRequestError, match="keeps no CPU KV tier"):
        await without.clear_kv_blocks("CPU")
    assert llm.calls == []


async def test_refused_reset_still_reports_the_host_tier_vllm_emptied(tiny) -> None:
    """vLLM resets the connector even when requests keep it from resetting the device cache."""
    engine = _running(tiny, 1 << 20, _ResettingLlm(succeed=False))
    with pytest.raises(UnavailableError, match="no request holds KV blocks"):
        await engine.clear_kv_blocks()
    assert engine.kv_feed._queue.get_nowait().event == KvCleared(medium="CPU")  # noqa: SLF001
    assert engine.kv_feed.table.num_blocks() == 1 and engine.kv_feed.table.num_blocks(medium="CPU") == 0


def test_host_tier_load_from_events_and_connector_stats(tiny) -> None:
    """Occupancy from the host-tier events, loads from vLLM's connector prefix-cache stats."""
    from types import SimpleNamespace

    engine = _running(tiny, offload.host_tier_bytes(64, BS, tiny.kv_geometry, []), _ResettingLlm())
    engine._host_tier_capacity = offload.host_tier_blocks(  # noqa: SLF001 - what start() learns
        engine._host_tier_bytes, BS, tiny.kv_geometry, []  # noqa: SLF001
    )
    assert engine._host_tier_capacity == 64  # noqa: SLF001
    stats = SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0, prefix_cache_stats=None,
                            connector_prefix_cache_stats=SimpleNamespace(queries=64, hits=3 * BS))
    engine._load.record(0, stats)  # noqa: SLF001 - vLLM's stat logger does this
    (load,) = engine.load_metrics()
    tier = load.kv_tiers["CPU"]
    assert (tier.blocks, tier.total_blocks, tier.offloaded_blocks) == (4, 64, 4)
    assert tier.usage == pytest.approx(4 / 64)
    assert (tier.hit_tokens, tier.onboarded_blocks) == (3 * BS, 3)
    assert VllmEngine(["--block-size", str(BS)], tiny, W2).load_metrics()[0].kv_tiers is None


# ---- the advertised host --------------------------------------------------------------------------


def test_side_channel_uses_the_advertised_host(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DYN_HOST", "DYN_ADVERTISE_HOST"):
        monkeypatch.delenv(name, raising=False)
    engine = adapter.create(_args(role="prefill", host="0.0.0.0", advertise_host="10.20.30.40"), tiny, worker_id=1)
    assert engine._advertise_host == "10.20.30.40"  # noqa: SLF001
    env = disagg.side_channel_env(engine._advertise_host, 1)  # noqa: SLF001
    if disagg._OPERATOR_SIDE_CHANNEL[disagg.SIDE_CHANNEL_HOST_ENV] is None:  # noqa: SLF001
        assert env[disagg.SIDE_CHANNEL_HOST_ENV] == "10.20.30.40"
    monkeypatch.setenv("DYN_ADVERTISE_HOST", "node-7.cluster")
    assert adapter.create(_args(role="prefill"), tiny, worker_id=2)._advertise_host == "node-7.cluster"  # noqa: SLF001
    monkeypatch.delenv("DYN_ADVERTISE_HOST")
    # No --advertise-host: the bind address, as every other listener of the daemon advertises.
    assert adapter.create(_args(role="prefill", host="10.0.0.5"), tiny, worker_id=3)._advertise_host == "10.0.0.5"  # noqa: SLF001
