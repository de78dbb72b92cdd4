"""``--kv-transfer-overlap`` on both sides: the prefill worker's setting reaches the engine's transfer
settings, and the frontend's (the same name) makes the cost policy's live transfer estimate count
only the exposed part; the replay keeps its own flag (with ``layer``)."""

from __future__ import annotations

import argparse

import pytest

from dynamod.daemon.frontend.main import add_args as add_frontend_args
from dynamod.daemon.replay.main import add_args as add_replay_args
from dynamod.daemon.router.core.disagg_cost import MockerCompute
from dynamod.daemon.router.core.disagg_policy import disagg_config_from_args
from dynamod.daemon.worker.kv_transfer import add_kv_transfer_args, kv_transfer_settings


def frontend_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    return parser


def replay_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_replay_args(parser)
    return parser


def _worker(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kv_transfer_args(parser)
    return parser.parse_args(argv)


def test_worker_flag_reaches_the_transfer_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_KV_TRANSFER_OVERLAP", raising=False)
    assert kv_transfer_settings(_worker([]), "h").overlap == "chunk"
    assert kv_transfer_settings(_worker(["--kv-transfer-overlap", "none"]), "h").overlap == "none"
    with pytest.raises(SystemExit):
        _worker(["--kv-transfer-overlap", "layer"])  # live transfers move whole chunks


def test_frontend_flag_sets_the_live_estimate_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_KV_TRANSFER_OVERLAP", raising=False)
    on = disagg_config_from_args(frontend_parser().parse_args(["--router-conditional-disagg"]))
    off = disagg_config_from_args(frontend_parser().parse_args(["--router-conditional-disagg", "--kv-transfer-overlap", "none"]))
    assert (on.transfer.overlap, off.transfer.overlap) == ("chunk", "none")
    # Overlapped, a long fresh prompt's transfer mostly hides behind its own prefill chunks.
    compute = MockerCompute(max_num_batched_tokens=2048)
    exposed_on = on.transfer.exposed_ms(compute, 8000, 0, 0)
    exposed_off = off.transfer.exposed_ms(compute, 8000, 0, 0)
    assert exposed_on < exposed_off / 2
    # The measured latency a decode worker reports keeps the overlap.
    assert on.transfer.measured(5.0, 4000).overlap == "chunk"


def test_replay_keeps_its_own_flag() -> None:
    args = replay_parser().parse_args(["--trace", "t.jsonl", "--kv-transfer-overlap", "layer"])
    assert args.kv_transfer_overlap == "layer"
    assert disagg_config_from_args(args).transfer_overlap == "layer"
