"""vLLM's own KV offloading (a host-memory tier behind the device cache), configured by the adapter.

``--num-host-blocks N`` (the mocker's flag, same meaning: host blocks per data-parallel rank) turns
on vLLM's ``OffloadingConnector`` with its ``CPUOffloadingSpec``: every computed block is copied to
pinned host memory, and a prompt whose prefix left the device cache is loaded back from there
instead of recomputed. vLLM sizes that tier in bytes (``cpu_bytes_to_use``, per engine, i.e. per
data-parallel rank, summed over its tensor-parallel workers), so the blocks become bytes from the
model's KV geometry (config.json) at the dtype vLLM will hold the cache in, each block rounded up
to the page size as vLLM's shared host region does. vLLM's own ``--kv-offloading-size GiB`` in
``--vllm-args`` is taken too (rewritten into the same connector config, which vLLM's shortcut
would build without the events below).

Events: the connector announces host copies as ``BlockStored``/``BlockRemoved`` with medium
``CPU``; only with ``self_describing_kv_events`` do they carry the token ids and parent the router
needs to index them (otherwise a placeholder with no tokens), so the adapter turns it on.

Disaggregation: a prefill or decode worker already runs the NIXL connector (disagg.py). Both go
through vLLM's ``MultiConnector``, NIXL first: a decode leg's remote blocks are claimed by NIXL
(the first child reporting matched tokens loads the request), any other request falls through to
the host tier; NIXL is the only child producing ``kv_transfer_params``.

Platform: vLLM 0.32 runs the CPU offloading worker only on CUDA-alike and XPU devices
(``CPUOffloadingSpec.get_worker``); ``check_platform`` says so in one line before the engine builds.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

from dynamod.daemon.engines.common.flags import flag_value, without_flag
from dynamod.daemon.engines.vllm import disagg
from dynamod.daemon.models.kv_layout import DTYPE_BYTES, KvGeometry
from dynamod.shared.errors import ConfigError

OFFLOADING_CONNECTOR = "OffloadingConnector"
MULTI_CONNECTOR = "MultiConnector"
KV_OFFLOADING_SIZE_FLAG = "--kv-offloading-size"
KV_OFFLOADING_BACKEND_FLAG = "--kv-offloading-backend"
PAGE_ALIGNMENT = mmap.PAGESIZE  # vLLM rounds each offloaded chunk up to this (SharedOffloadRegion)
_GIB = 1 << 30


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def kv_cache_dtype_bytes(tokens: Sequence[str], geometry: KvGeometry) -> int:
    """Bytes per KV element as vLLM will hold them: ``--kv-cache-dtype`` when set (fp8: 1), else
    ``--dtype`` when set, else the checkpoint's dtype, which vLLM's ``auto`` downcasts from
    float32 to a 16-bit type."""
    kv_dtype = (flag_value(tokens, "--kv-cache-dtype") or "auto").lower()
    if kv_dtype != "auto":
        return 1 if kv_dtype.startswith("fp8") else DTYPE_BYTES.get(kv_dtype, 2)
    dtype = (flag_value(tokens, "--dtype") or "auto").lower()
    if dtype != "auto":
        return DTYPE_BYTES.get(dtype, 2)
    return min(geometry.dtype_bytes, 2)


def host_tier_bytes(num_blocks: int, block_size: int, geometry: KvGeometry, tokens: Sequence[str]) -> int:
    """``cpu_bytes_to_use`` that gives vLLM exactly ``num_blocks`` host blocks of ``block_size``
    tokens (one block per offloaded chunk, each rounded up to the page size as vLLM does)."""
    per_token = geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * 2
    per_block = per_token * kv_cache_dtype_bytes(tokens, geometry) * block_size
    return num_blocks * _round_up(per_block, PAGE_ALIGNMENT)


def host_tier_blocks(cpu_bytes: int, block_size: int, geometry: KvGeometry | None, tokens: Sequence[str]) -> int:
    """How many blocks vLLM makes of ``cpu_bytes`` (0 when the model's KV geometry is unknown)."""
    if geometry is None:
        return 0
    return cpu_bytes // host_tier_bytes(1, block_size, geometry, tokens)


def offloading_connector(cpu_bytes: int) -> dict[str, Any]:
    """vLLM's CPU offloading connector with events the router can index."""
    return {
        "kv_connector": OFFLOADING_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "self_describing_kv_events": True},
    }


def combine(transfer: dict[str, Any] | None, offload: dict[str, Any] | None) -> dict[str, Any] | None:
    """One ``--kv-transfer-config`` for the disaggregation connector and the offloading one:
    either alone as is, both through ``MultiConnector`` (transfer first, see the docstring)."""
    if transfer is None or offload is None:
        return transfer or offload
    return {
        "kv_connector": MULTI_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [transfer, offload]},
    }


def host_tier_request(
    tokens: Sequence[str], num_host_blocks: int, block_size: int, geometry: KvGeometry | None
) -> int | None:
    """The host tier's ``cpu_bytes_to_use`` the operator asked for (``--num-host-blocks`` or vLLM's
    ``--kv-offloading-size``), or None when the tier is off."""
    if num_host_blocks < 0:
        raise ConfigError(f"--num-host-blocks must be an integer >= 0 (0: no host tier), got {num_host_blocks}")
    size = flag_value(tokens, KV_OFFLOADING_SIZE_FLAG)
    backend = (flag_value(tokens, KV_OFFLOADING_BACKEND_FLAG) or "native").lower()
    if size is not None and backend != "native":
        if num_host_blocks:
            raise ConfigError(f"--num-host-blocks drives vLLM's native offloading; drop it with {KV_OFFLOADING_BACKEND_FLAG} {backend}")
        return None  # another backend (LMCache): vLLM configures it, its events are its own
    if size is not None and num_host_blocks:
        raise ConfigError(f"give the host KV tier once: --num-host-blocks or {KV_OFFLOADING_SIZE_FLAG} in --vllm-args")
    if size is not None:
        try:
            gib = float(size)
        except ValueError:
            raise ConfigError(f"{KV_OFFLOADING_SIZE_FLAG} must be a number of GiB, got {size!r}") from None
        if gib <= 0:
            raise ConfigError(f"{KV_OFFLOADING_SIZE_FLAG} must be above 0 GiB, got {size}")
        return int(gib * _GIB)
    if not num_host_blocks:
        return None
    if geometry is None:
        raise ConfigError(
            "--num-host-blocks needs the model's KV geometry (num_hidden_layers, num_key_value_heads, head_dim in "
            f"config.json); size the host tier in bytes instead with {KV_OFFLOADING_SIZE_FLAG} GiB in --vllm-args"
        )
    return host_tier_bytes(num_host_blocks, block_size, geometry, tokens)


def without_offloading_flags(tokens: Sequence[str]) -> list[str]:
    """The vLLM flags minus vLLM's native offloading shortcut, which ``offloading_connector``
    replaces (vLLM would otherwise build its own connector config over ours)."""
    if (flag_value(tokens, KV_OFFLOADING_BACKEND_FLAG) or "native").lower() != "native":
        return list(tokens)
    return without_flag(without_flag(list(tokens), KV_OFFLOADING_SIZE_FLAG), KV_OFFLOADING_BACKEND_FLAG)


def kv_transfer_config(role: str, tokens: Sequence[str], host_bytes: int | None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` the adapter adds: the role's connector (disagg.py), the host
    tier's, both, or None. An operator's own ``--kv-transfer-config`` is used as given, which
    cannot also carry the host tier the adapter would configure."""
    transfer = disagg.kv_transfer_config(role, tokens)
    if host_bytes is None:
        return transfer
    if disagg.user_kv_transfer_config(tokens) is not None:
        raise ConfigError(
            "--kv-transfer-config in --vllm-args replaces the connectors dynamod configures; drop it, or drop "
            "--num-host-blocks and put vLLM's OffloadingConnector (through MultiConnector) in your own config"
        )
    return combine(transfer, offloading_connector(host_bytes))


def check_platform() -> None:
    """Refuses the host tier where vLLM's CPU offloading worker cannot run (imports vLLM)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return
    device = current_platform.device_type or "unknown"
    raise ConfigError(
        f"vLLM's KV offloading to host memory runs on CUDA, ROCm and XPU only, not on this {device} build "
        "(CPUOffloadingSpec.get_worker refuses it); start the worker without --num-host-blocks/--kv-offloading-size"
    )
