"""The SLA planner's performance profile for a ``dynamod up`` cluster of mocker workers.

The SLA planner sizes pools by comparing predicted traffic with a profile of the engine. The
profile shipped in the package describes a mocker with default flags; a cluster started with
``--speedup-ratio 0.1`` or a small ``--num-gpu-blocks`` runs ten times slower or holds fewer
sequences, and a planner reading the shipped file would size it for an engine it does not have.
So ``up --planner sla`` measures the mocker its workers actually run (the in-process sweep of
``dynamod profile``: deterministic, a few seconds) and hands the planner that file, unless the
operator named one. Prefill and decode workers can carry different flags (``--prefill-args``,
``--decode-args``): each table is measured with its own pool's flags.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from dynamod.daemon.engines.mocker.config import MockerConfig, add_mocker_flags, config_from_args
from dynamod.daemon.perf.profile import PerfProfile
from dynamod.daemon.profile.main import PROFILE_VOCAB
from dynamod.daemon.profile.sweep import SweepPlan, sweep_mocker
from dynamod.shared.errors import ConfigError

logger = logging.getLogger(__name__)


def mocker_config(worker_argv: Sequence[str]) -> MockerConfig:
    """The mocker config a worker started with ``worker_argv`` runs: its mocker flags; its other
    flags are not ours to read. A malformed mocker flag is a ``ConfigError`` (the worker would
    refuse it too), not an argparse exit."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False, exit_on_error=False)
    add_mocker_flags(parser)
    try:
        known, _ = parser.parse_known_args(list(worker_argv))
    except argparse.ArgumentError as exc:
        raise ConfigError(f"worker flags: {exc}") from exc
    config = config_from_args(known, vocab_size=PROFILE_VOCAB)
    config.validate()
    return config


def measure(prefill_argv: Sequence[str] | None, decode_argv: Sequence[str], plan: SweepPlan | None = None) -> PerfProfile:
    """The profile of the decode (or agg) pool's mocker, with the prefill table measured on the
    prefill pool's mocker when its flags differ."""
    decode_config = mocker_config(decode_argv)
    profile = sweep_mocker(decode_config, plan)
    if prefill_argv is None:
        return profile
    prefill_config = mocker_config(prefill_argv)
    if prefill_config == decode_config:
        return profile
    prefill = sweep_mocker(prefill_config, plan)
    settings = dict(profile.settings, prefill_settings=prefill.settings)
    return PerfProfile(prefill.prefill, profile.decode, engine=profile.engine, settings=settings).validate()


def write_profile(path: Path, prefill_argv: Sequence[str] | None, decode_argv: Sequence[str]) -> Path:
    profile = measure(prefill_argv, decode_argv)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    logger.info(
        "event=planner_profile path=%s engine=mocker speedup_ratio=%g prefill_points=%d decode_rows=%d",
        path, profile.settings.get("speedup_ratio", 1.0), len(profile.prefill.isl), len(profile.decode.rows),
    )
    return path
