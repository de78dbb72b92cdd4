"""Mocker settings: Dynamo's defaults and flag names, and errors that name the bad flag."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.engines.mocker.config import MockerConfig, add_mocker_args, config_from_args
from dynamod.shared.errors import ConfigError


def test_defaults_follow_dynamo():
    cfg = MockerConfig()
    assert (cfg.num_gpu_blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (16384, 64, 256, 8192)
    assert cfg.enable_prefix_caching is True
    assert (cfg.watermark, cfg.speedup_ratio, cfg.data_parallel_size) == (0.01, 1.0, 1)
    assert cfg.context_length == 16384 * 64  # 0 means: as long as the KV cache holds
    assert cfg.watermark_blocks == 163


def test_flags_parse_into_a_config():
    parser = argparse.ArgumentParser()
    add_mocker_args(parser)
    ns = parser.parse_args(
        [
            "--num-gpu-blocks", "100", "--block-size", "16", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--watermark", "0.05",
            "--speedup-ratio", "10", "--data-parallel-size", "2",
        ]
    )
    cfg = config_from_args(ns, vocab_size=1000, eos_token_ids=[2], context_length=1024)
    assert cfg == MockerConfig(
        num_gpu_blocks=100, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
        enable_prefix_caching=False, watermark=0.05, speedup_ratio=10.0, data_parallel_size=2,
        vocab_size=1000, eos_token_ids=(2,), context_length=1024,
    )
    defaults = config_from_args(parser.parse_args([]))
    assert defaults == MockerConfig()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_gpu_blocks": 0}, "--num-gpu-blocks must be a positive integer"),
        ({"block_size": -1}, "--block-size"),
        ({"watermark": 1.0}, r"--watermark must be in \[0, 1\)"),
        ({"speedup_ratio": 0}, "--speedup-ratio must be > 0"),
        ({"data_parallel_size": 0}, "--data-parallel-size"),
        ({"num_gpu_blocks": 4, "block_size": 4, "context_length": 100}, "exceeds the KV cache capacity of 16 tokens"),
        ({"vocab_size": 10, "eos_token_ids": (10,)}, "outside the vocabulary"),
    ],
)
def test_bad_settings_raise_config_errors_naming_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MockerConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        MockerConfig(**kwargs)


def test_adapter_builds_an_engine_from_flags_and_the_model():
    from dynamod.daemon.engines.mocker import adapter
    from dynamod.daemon.models.local import resolve_model

    parser = argparse.ArgumentParser()
    adapter.add_args(parser.add_argument_group("mocker engine"))
    model = resolve_model("tiny")
    engine = adapter.create(parser.parse_args([]), model, worker_id=7)
    assert engine.worker_id == 7
    assert engine.info.vocab_size == model.vocab_size
    assert engine.info.eos_token_ids == list(model.eos_token_ids)
    assert engine.info.context_length == model.context_length
    # A KV cache smaller than the model's context caps the context it advertises.
    small = adapter.create(parser.parse_args(["--num-gpu-blocks", "8", "--block-size", "16"]), model, worker_id=8)
    assert small.info.context_length == 128 < model.context_length
