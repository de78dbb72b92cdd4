"""The flags the planner daemon, `dynamod up` and replay share, and the factory behind them."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.planner.load_policy import LoadPolicy
from dynamod.daemon.planner.policy_args import add_policy_args, build_policy
from dynamod.daemon.planner.sla_policy import SlaPolicy
from dynamod.shared.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_policy_args(p)
    return p.parse_args(list(argv))


def test_defaults_are_dynamos() -> None:
    policy = build_policy(parse())
    assert isinstance(policy, LoadPolicy)
    assert policy.interval_s == 5.0 and policy.config.optimization_target == "throughput"
    assert policy.config.budget.max_gpu_budget == 8 and policy.config.budget.decode_min == 1
    sla = build_policy(parse("--planner", "sla", "--load-predictor", "constant"))
    assert isinstance(sla, SlaPolicy)
    # Two loops: the slow (predictive) one every 180 s as Dynamo's, the fast (reactive) one every
    # 5 s, which is how often the policy is asked (was 180 s: misses waited three minutes).
    assert (sla.config.interval_s, sla.config.ttft_ms, sla.config.itl_ms) == (180.0, 500.0, 50.0)
    assert sla.interval_s == 5.0
    assert sla.profile.engine == "mocker"


def test_aliases_and_env_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_PLANNER_TTFT", "250")
    monkeypatch.setenv("DYN_PLANNER", "sla")
    args = parse("--min-workers", "2", "--max-workers", "4", "--load-predictor", "constant", "--mode", "agg")
    policy = build_policy(args)
    assert isinstance(policy, SlaPolicy) and policy.config.ttft_ms == 250.0
    assert policy.config.budget.decode_min == 2 and policy.config.budget.max_replicas == 4
    assert parse("--ttft", "100").ttft == 100.0  # the flag wins over the environment


def test_bad_settings_are_config_errors(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="needs --decode-scale-up-kv-rate"):
        build_policy(parse("--optimization-target", "load"))
    with pytest.raises(ConfigError, match="not found"):
        build_policy(parse("--planner", "sla", "--profile", str(tmp_path / "none.json")))
    with pytest.raises(ConfigError, match="below the minimum"):
        build_policy(parse("--min-endpoint", "3", "--max-replicas", "2"))
    monkeypatch.setenv("DYN_PLANNER_ITL", "fast")
    p = argparse.ArgumentParser()
    with pytest.raises(ConfigError, match="DYN_PLANNER_ITL"):
        add_policy_args(p)
