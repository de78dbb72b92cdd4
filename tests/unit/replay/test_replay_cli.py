"""``dynamod replay`` from the command line: JSON out, and one-line errors for bad flag combinations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamod.daemon.cli import main
from tests.unit.replay.helpers import write_trace

SMALL = ["--num-gpu-blocks", "256", "--block-size", "16", "--trace-block-size", "16"]


@pytest.fixture
def trace(tmp_path: Path) -> str:
    rows = [(i * 20.0, [i % 3, 10 + i % 3, 100 + i], 4) for i in range(12)]
    return str(write_trace(tmp_path / "trace.jsonl", rows))


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_disagg_json_reports_pools_transfers_and_decisions(trace: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, ["replay", "--trace", trace, *SMALL, "--prefill-workers", "1", "--decode-workers", "2",
                                  "--router-conditional-disagg", "--kv-transfer-bandwidth", "5", "--json"])
    assert code == 0, err
    res = json.loads(out)
    assert res["topology"] == "disagg" and (res["prefill_workers"], res["decode_workers"]) == (1, 2)
    assert res["completed"] == 12
    assert res["disagg"]["remote"] + res["disagg"]["local"] == 12
    assert set(res["busy_fraction"]) == {"prefill", "decode"}
    assert {"p50", "p99", "p999"} <= set(res["itl_ms"])
    assert res["decode_step_ms"]["p99"] > 0


def test_agg_is_still_the_default(trace: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, ["replay", "--trace", trace, *SMALL, "--json"])
    assert code == 0, err
    res = json.loads(out)
    assert res["workers"] == 8 and "disagg" not in res


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--workers", "8", "--prefill-workers", "2", "--decode-workers", "6"], "--workers is for aggregated"),
        (["--prefill-workers", "2"], "needs both"),
        (["--decode-workers", "0", "--prefill-workers", "1"], "--decode-workers must be at least 1"),
        (["--prefill-workers", "-1", "--decode-workers", "2"], "--prefill-workers must be >= 0"),
        (["--prefill-workers", "0", "--decode-workers", "2", "--no-decode-fallback"], "no worker to prefill"),
        (["--router-conditional-disagg"], "needs --prefill-workers"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--kv-transfer-bandwidth", "0"], "--kv-transfer-bandwidth"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--router-conditional-disagg-config", "{bad"], "not valid JSON"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--router-conditional-disagg-config", '{"policy": "x"}'],
         "unknown"),
        (["--workers", "0"], "--workers must be at least 1"),
    ],
)
def test_bad_flag_combinations_exit_2_with_one_line(
    trace: str, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    code, out, err = run(capsys, ["replay", "--trace", trace, *SMALL, *flags])
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dynamod replay: error:") and says in lines[0]
    assert "Traceback" not in err
