"""Router flags: Dynamo's names and defaults, DYN_ROUTER_* fallbacks, CLI wins."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.router.core import KvRouterConfig, add_router_args, config_from_args
from dynamod.shared.errors import ConfigError


def _parse(argv: list[str]) -> KvRouterConfig:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_follow_dynamo():
    cfg = _parse([])
    assert cfg == KvRouterConfig()
    assert (cfg.overlap_score_weight, cfg.router_temperature, cfg.use_kv_events) == (1.0, 0.0, True)
    assert (cfg.router_ttl_secs, cfg.router_max_tree_size, cfg.router_prune_target_ratio) == (120.0, 1048576, 0.8)
    assert cfg.router_replica_sync is False
    assert cfg.active_decode_blocks_threshold is None and cfg.active_prefill_tokens_threshold is None


def test_flags(monkeypatch):
    cfg = _parse(
        [
            "--kv-overlap-score-weight", "0.5",
            "--router-temperature", "0.7",
            "--no-router-kv-events",
            "--router-ttl-secs", "30",
            "--router-max-tree-size", "1000",
            "--router-prune-target-ratio", "0.5",
            "--router-replica-sync",
            "--active-decode-blocks-threshold", "0.9",
            "--active-prefill-tokens-threshold", "8192",
        ]
    )  # fmt: skip
    assert cfg.overlap_score_weight == 0.5 and cfg.router_temperature == 0.7
    assert cfg.use_kv_events is False and cfg.router_replica_sync is True
    assert (cfg.router_ttl_secs, cfg.router_max_tree_size, cfg.router_prune_target_ratio) == (30, 1000, 0.5)
    assert (cfg.active_decode_blocks_threshold, cfg.active_prefill_tokens_threshold) == (0.9, 8192)
    assert _parse(["--router-kv-overlap-score-weight", "2"]).overlap_score_weight == 2.0


def test_env_fallback_and_cli_wins(monkeypatch):
    monkeypatch.setenv("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "3")
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    monkeypatch.setenv("DYN_ROUTER_ACTIVE_PREFILL_TOKENS_THRESHOLD", "100")
    monkeypatch.setenv("DYN_ROUTER_TEMPERATURE", "0.2")
    cfg = _parse(["--router-temperature", "0.4", "--router-kv-events"])
    assert cfg.overlap_score_weight == 3.0
    assert cfg.active_prefill_tokens_threshold == 100
    assert cfg.router_temperature == 0.4  # flag beats env
    assert cfg.use_kv_events is True


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("DYN_ROUTER_USE_KV_EVENTS", "maybe"),
        ("DYN_ROUTER_TTL_SECS", "soon"),
        ("DYN_ROUTER_ACTIVE_DECODE_BLOCKS_THRESHOLD", "80"),  # a share, not a percentage
        ("DYN_ROUTER_PRUNE_TARGET_RATIO", "1.5"),
    ],
)
def test_bad_values_are_config_errors(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError):
        _parse([])


def test_help_names_env_and_default():
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    assert "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT, default 1.0" in text
    assert "--no-router-kv-events" in text
    assert "DYN_ROUTER_MAX_TREE_SIZE, default 1048576" in text
