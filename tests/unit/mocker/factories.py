"""Small builders for mocker tests: tiny pools so exact block ids and refcounts can be asserted."""

from __future__ import annotations

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.engines.mocker.core import MockerCore, StepOutput


def make_config(**overrides) -> MockerConfig:
    """A tiny engine: 16 blocks of 4 tokens, no watermark, a 100-token vocabulary."""
    knobs = dict(
        num_gpu_blocks=16,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        watermark=0.0,
        vocab_size=100,
    )
    knobs.update(overrides)
    return MockerConfig(**knobs)


def make_core(**overrides) -> MockerCore:
    return MockerCore(make_config(**overrides))


def run_to_completion(core: MockerCore, max_steps: int = 10_000) -> list[StepOutput]:
    """Steps until no request is left; fails loudly instead of looping forever."""
    outs = []
    while core.has_unfinished_requests():
        out = core.step()
        if not out.req_ids and not out.duration_ms and core.io_pending:
            # Requests wait for disk-tier reads: block until some I/O ends instead of spinning.
            if not core.wait_for_io(10.0):
                raise AssertionError("disk tier I/O did not finish within 10 s")
            if out.kv_events:
                outs.append(out)
            continue
        outs.append(out)
        if len(outs) > max_steps:
            raise AssertionError(f"core did not finish within {max_steps} steps")
    return outs


def tokens_by_request(outs: list[StepOutput]) -> dict[str, list[int]]:
    produced: dict[str, list[int]] = {}
    for out in outs:
        for rid, tok in zip(out.req_ids, out.token_ids, strict=True):
            produced.setdefault(rid, []).append(tok)
    return produced


def finished_by_request(outs: list[StepOutput]) -> dict:
    return {f.request_id: f for out in outs for f in out.finished}
