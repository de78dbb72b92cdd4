"""Profile tables: interpolation, the file format and its errors, and the shipped mocker profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamod.daemon.engines.mocker.config import MockerConfig
from dynamod.daemon.perf.profile import (
    DecodeRow,
    DecodeTable,
    PerfProfile,
    PrefillTable,
    ProfileError,
    default_profile_path,
)
from dynamod.daemon.profile.sweep import SweepPlan, measure_decode, measure_prefill, sweep_mocker


def small() -> PerfProfile:
    return PerfProfile(
        PrefillTable([100.0, 200.0], [10.0, 30.0], [1000.0, 2000.0]),
        DecodeTable([DecodeRow(1000.0, [0.1, 0.5], [10.0, 20.0], [100.0, 500.0]),
                     DecodeRow(3000.0, [0.1, 0.5], [20.0, 40.0], [50.0, 250.0])], max_kv_tokens=10_000),
    ).validate()


def test_interpolation_is_linear_and_clamped() -> None:
    p = small()
    assert p.prefill.ttft(150) == pytest.approx(20.0)
    assert p.prefill.ttft(50) == 10.0 and p.prefill.ttft(10_000) == 30.0  # no extrapolation
    assert p.decode.itl(0.3, 1000) == pytest.approx(15.0)
    assert p.decode.itl(0.3, 2000) == pytest.approx((15.0 + 30.0) / 2)  # between the two rows
    assert p.decode.itl(0.9, 9000) == 40.0
    assert p.decode.kv_usage_for(4, 1000) == pytest.approx(0.4)
    thpt, usage, itl = p.decode.best_throughput_per_gpu(15.0, 1000)
    assert usage == pytest.approx(0.3) and itl == pytest.approx(15.0) and thpt == pytest.approx(300.0)
    assert p.decode.best_throughput_per_gpu(1.0, 1000) == (100.0, 0.1, 10.0)  # unreachable: the lightest load


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    small().save(path)
    loaded = PerfProfile.load(path)
    assert loaded.to_json() == small().to_json()
    assert loaded.source == str(path)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(schema_version=99), "schema_version 99"),
    (lambda d: d.update(kind="other"), "not a dynamod performance profile"),
    (lambda d: d["prefill"].update(isl=[200, 100]), "prefill.isl: must be strictly increasing"),
    (lambda d: d["prefill"].update(ttft_ms=[1.0]), "of one length"),
    (lambda d: d["decode"]["rows"][0].update(itl_ms=["x", 1]), r"decode.rows\[0\].itl_ms"),
    (lambda d: d["decode"].pop("max_kv_tokens"), "max_kv_tokens"),
    (lambda d: d.pop("decode"), "decode: missing"),
])
def test_bad_files_name_the_field(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = small().to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message) as info:
        PerfProfile.load(path)
    assert str(path) in str(info.value)


def test_missing_and_unparsable(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not found; write one with `dynamod profile"):
        PerfProfile.load(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        PerfProfile.load(tmp_path / "x.json")


def test_shipped_mocker_profile_loads_is_monotone_and_matches_a_fresh_measurement() -> None:
    p = PerfProfile.load(default_profile_path())
    assert p.engine == "mocker" and len(p.prefill.isl) >= 5 and len(p.decode.rows) >= 4
    assert p.prefill.ttft_ms == sorted(p.prefill.ttft_ms)  # longer prompts never prefill faster
    for row in p.decode.rows:
        assert row.itl_ms == sorted(row.itl_ms)  # a fuller batch never decodes a token faster
        assert row.thpt_per_gpu == sorted(row.thpt_per_gpu)
    # The same mocker, re-measured at a few points, gives the same figures (regenerate the file
    # with `dynamod profile -o daemon/assets/profiles/mocker.json` when the timing model changes).
    config = MockerConfig(vocab_size=32000)
    for i in (0, len(p.prefill.isl) // 2, len(p.prefill.isl) - 1):
        assert measure_prefill(config, int(p.prefill.isl[i])) == pytest.approx(p.prefill.ttft_ms[i], rel=1e-3)
    osl = int(p.settings["decode_osl"])
    assert osl == SweepPlan().decode_osl
    row = p.decode.rows[1]
    context = int(row.context_length - osl / 2)
    for n, itl in zip((1, 2, 4), row.itl_ms[:3], strict=True):
        assert measure_decode(config, context, n, osl) == pytest.approx(itl, rel=1e-3)


def test_a_slowed_mocker_profiles_at_its_wall_clock_speed() -> None:
    """A live mocker at ``--speedup-ratio 0.25`` takes four times the simulated step time on the
    wall clock, which is what frontends measure and the SLA planner compares with the profile."""
    plan = SweepPlan(isls=(128, 512), contexts=(512,), concurrencies=(1, 4), decode_osl=8)
    base = sweep_mocker(MockerConfig(vocab_size=32000), plan)
    slow = sweep_mocker(MockerConfig(vocab_size=32000, speedup_ratio=0.25), plan)
    assert slow.settings["speedup_ratio"] == 0.25
    for fast_ttft, slow_ttft in zip(base.prefill.ttft_ms, slow.prefill.ttft_ms, strict=True):
        assert slow_ttft == pytest.approx(4 * fast_ttft, rel=1e-3)
    for fast_thpt, slow_thpt in zip(base.prefill.thpt_per_gpu, slow.prefill.thpt_per_gpu, strict=True):
        assert slow_thpt == pytest.approx(fast_thpt / 4, rel=1e-3)
    fast_row, slow_row = base.decode.rows[0], slow.decode.rows[0]
    assert slow_row.itl_ms == pytest.approx([4 * x for x in fast_row.itl_ms], rel=1e-3)
    assert slow_row.kv_usage == fast_row.kv_usage


def test_prefill_points_leave_room_for_the_output_token() -> None:
    """A 4096-token context cannot prefill a 4096-token prompt and still answer (the engine refuses
    it): the sweep stops below the context length instead of failing the whole profile."""
    assert SweepPlan(isls=(1024, 2048, 4096, 8192)).prefill_points(4096) == [1024, 2048]
    profile = sweep_mocker(MockerConfig(vocab_size=32000, num_gpu_blocks=256, block_size=16, max_num_seqs=16),
                           SweepPlan(isls=(1024, 2048, 4096), contexts=(512,), concurrencies=(1, 2)))
    assert profile.prefill.isl == [1024.0, 2048.0]
