"""Dynamo's timing model, exactly, and how a core charges it per step."""

from __future__ import annotations

import pytest

from dynamod.daemon.perf.mocker_timing import decode_time_ms, prefill_time_ms, step_time_ms
from tests.unit.mocker.factories import make_core


@pytest.mark.parametrize(
    ("tokens", "ms"),
    [
        (0, 0.0),
        (1, 4.209989e-07 + 1.518344e-02 + 16.50142),
        (1000, 0.4209989 + 15.18344 + 16.50142),  # 32.1058589
        (8192, 4.209989e-07 * 8192**2 + 1.518344e-02 * 8192 + 16.50142),
    ],
)
def test_prefill_time(tokens, ms):
    assert prefill_time_ms(tokens) == pytest.approx(ms, rel=1e-12)


def test_prefill_time_known_values():
    assert prefill_time_ms(1000) == pytest.approx(32.1058589, abs=1e-9)
    assert prefill_time_ms(8192) == pytest.approx(169.1369184, abs=1e-6)


@pytest.mark.parametrize(
    ("p", "ms"),
    [(0.0, 5.74), (0.5, 26.31), (1.0, 34.01), (2.0, 34.01), (-1.0, 5.74)],
)
def test_decode_time(p, ms):
    assert decode_time_ms(p) == pytest.approx(ms, abs=1e-9)


def test_mixed_step_pays_prefill_and_decode():
    assert step_time_ms(1000, 3, 0.5) == pytest.approx(32.1058589 + 26.31, abs=1e-9)
    assert step_time_ms(0, 0, 0.9) == 0.0


def test_core_charges_uncached_prefill_then_decode_at_kv_occupancy():
    core = make_core(num_gpu_blocks=20, block_size=4, max_num_batched_tokens=64)
    core.add_request("a", list(range(10)), max_tokens=3)
    first = core.step()
    assert first.num_prefill_tokens == 10 and first.num_decode_reqs == 0
    assert first.duration_ms == pytest.approx(prefill_time_ms(10), rel=1e-12)
    second = core.step()
    # 11 tokens known after the first output: 3 blocks of 20 held.
    assert second.num_prefill_tokens == 0 and second.num_decode_reqs == 1
    assert second.duration_ms == pytest.approx(decode_time_ms(3 / 20), rel=1e-12)

    # The same prompt again: 8 of its 10 tokens are cached, so only 2 cost prefill time.
    core.add_request("b", list(range(10)), max_tokens=3)
    mixed = core.step()
    assert mixed.num_prefill_tokens == 2 and mixed.num_decode_reqs == 1
    assert mixed.duration_ms == pytest.approx(prefill_time_ms(2) + decode_time_ms(mixed.kv_usage), rel=1e-12)
    assert core.simulated_ms == pytest.approx(first.duration_ms + second.duration_ms + mixed.duration_ms)
