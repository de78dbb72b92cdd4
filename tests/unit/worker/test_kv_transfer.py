"""The worker's KV transfer pieces: layouts from config.json, settings from flags, statistics."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.engines.mocker.adapter import add_args, kv_layout_for
from dynamod.daemon.models import geometry_for_bytes_per_token, kv_geometry, resolve_model
from dynamod.daemon.worker.kv_transfer import KvTransferStats, add_kv_transfer_args, kv_transfer_settings
from dynamod.shared.errors import ConfigError
from dynamod.shared.kv.transfer.base import TransferResult


def test_tiny_model_geometry_is_its_config():
    geometry = resolve_model("tiny").kv_geometry
    assert geometry is not None
    layout = geometry.layout(16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype_bytes) == (2, 2, 16, 4)
    assert layout.bytes_per_token == 512 and layout.block_bytes == 512 * 16


@pytest.mark.parametrize(
    ("config", "bytes_per_token"),
    [
        # Llama 3 8B: GQA with 8 KV heads of 128, bf16.
        ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
          "torch_dtype": "bfloat16"}, 32 * 8 * 128 * 2 * 2),
        # Pre-GQA: one KV head per attention head, head_dim from hidden_size.
        ({"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768, "torch_dtype": "float32"},
         12 * 12 * 64 * 2 * 4),
        # Multimodal: the language model's shape sits under text_config; no dtype: bf16.
        ({"text_config": {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}},
         4 * 2 * 64 * 2 * 2),
    ],
)
def test_geometry_from_hf_configs(config, bytes_per_token):
    geometry = kv_geometry(config)
    assert geometry is not None and geometry.bytes_per_token == bytes_per_token


def test_config_without_attention_shape_has_no_geometry():
    assert kv_geometry({"vocab_size": 100}) is None


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_args(parser)
    add_kv_transfer_args(parser)
    parser.add_argument("--role", default="agg")
    return parser.parse_args(argv)


def test_layout_only_for_disaggregated_roles_and_the_override_wins():
    tiny = resolve_model("tiny")
    assert kv_layout_for(parse(["--role", "agg", "--block-size", "16"]), tiny) is None
    assert kv_layout_for(parse(["--role", "decode", "--block-size", "16"]), tiny).block_bytes == 512 * 16
    big = kv_layout_for(parse(["--role", "prefill", "--block-size", "16", "--kv-bytes-per-token", "131072"]), tiny)
    assert big.bytes_per_token == 131072 and big.block_bytes == 131072 * 16
    with pytest.raises(ConfigError):
        geometry_for_bytes_per_token(7)


def test_settings_from_flags():
    args = parse(["--kv-transfer-backend", "tcp", "--kv-transfer-port", "7000", "--kv-hold-timeout", "5"])
    first, second = kv_transfer_settings(args, "10.0.0.5", 0), kv_transfer_settings(args, "10.0.0.5", 1)
    assert (first.backend, first.host, first.port, first.hold_timeout_s) == ("tcp", "10.0.0.5", 7000, 5.0)
    assert second.port == 7001 and first.transfer_timeout_s == 10.0 and first.peer_component == "prefill"
    assert kv_transfer_settings(parse([]), "h").port == 0
    with pytest.raises(ConfigError, match="--kv-transfer-timeout"):
        kv_transfer_settings(parse(["--kv-transfer-timeout", "0"]), "h")


def test_stats_percentiles_over_a_window_and_failures_by_reason():
    stats = KvTransferStats(0xAB, "tcp")
    assert stats.percentiles_ms() == (0.0, 0.0)
    for ms in range(1, 101):
        stats.pulled(TransferResult(num_blocks=2, num_bytes=100, seconds=ms / 1000, backend="tcp"))
    p50, p99 = stats.percentiles_ms()
    assert p50 == pytest.approx(50.0, abs=1.0) and p99 == pytest.approx(99.0, abs=1.0)
    assert stats.bytes_total == 10_000 and stats.transfers == 100
    stats.failed("timeout")
    stats.failed("timeout")
    stats.failed("checksum")
    assert stats.failures == 3 and stats.failures_by_reason == {"timeout": 2, "checksum": 1}
