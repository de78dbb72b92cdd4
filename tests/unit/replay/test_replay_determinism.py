"""A replay is a pure function of its trace, flags and seed: the same figures in another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamod.daemon.replay.simulator import MODES, TransferModel, _PromptHashes, _Simulation
from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from dynamod.shared.kv.hashing import hash_tokens
from tests.unit.replay.helpers import mixed_trace, mocker

REPO = Path(__file__).resolve().parents[3]

# Every routing mode, aggregated and disaggregated (conditional, so both decisions occur), on a
# trace busy enough to batch, queue, evict and break ties.
_DRIVER = """
import json
from dynamod.daemon.replay.simulator import MODES, TransferModel, replay, replay_disagg
from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from tests.unit.replay.helpers import mixed_trace, mocker
out = {}
for mode in MODES:
    out["agg-" + mode] = replay(mixed_trace(90), workers=3, mode=mode, mocker=mocker(num_gpu_blocks=96), seed=5)
    out["disagg-" + mode] = replay_disagg(
        mixed_trace(90), prefill_workers=2, decode_workers=2, mode=mode, mocker=mocker(num_gpu_blocks=96),
        policy=DisaggPolicyConfig(enabled=True), transfer=TransferModel(1000, 0.01, 1.0), seed=5)
print(json.dumps(out, sort_keys=True))
"""


def _replay_in_subprocess(hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([sys.executable, "-c", _DRIVER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_figures_do_not_depend_on_the_process_or_its_hash_seed() -> None:
    first = _replay_in_subprocess("1")
    second = _replay_in_subprocess("2")
    assert first.keys() == second.keys()
    for key in first:
        assert first[key] == second[key], key
        assert first[key]["completed"] == 90, key


def _simulate(mode: str, disagg: bool) -> _Simulation:
    sim = _Simulation(prefill_workers=2 if disagg else 0, decode_workers=2 if disagg else 3, mode=mode,
                      mocker=mocker(num_gpu_blocks=96), router_config=None, seed=5,
                      policy=DisaggPolicyConfig(enabled=True) if disagg else None, transfer=TransferModel(1000, 0.01, 1.0))
    sim.run(mixed_trace(90))
    return sim


@pytest.mark.parametrize("disagg", [False, True], ids=["agg", "disagg"])
@pytest.mark.parametrize("mode", MODES)
def test_prompts_hashed_once_give_the_figures_of_hashing_at_every_use(
    mode: str, disagg: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each prompt is hashed once and its hashes handed to every router and core that uses it;
    the replay must be the one in which each of them hashes for itself, and no request may keep
    its hashes once its decode core has it."""
    shared = _simulate(mode, disagg)
    assert len(shared.hashes) == 0
    monkeypatch.setattr(_PromptHashes, "of", lambda self, rid, prompt: hash_tokens(prompt, self._block_size))
    monkeypatch.setattr(_PromptHashes, "for_core", lambda self, request, last: hash_tokens(request.token_ids, self._block_size))
    alone = _simulate(mode, disagg)
    assert alone.stats == shared.stats
    assert alone.report(mode) == shared.report(mode)
