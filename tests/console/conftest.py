"""Console test fixtures: the recorded cluster picture, replayed with its own (frozen) clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import read_records, replay

RECORDING = Path(__file__).parent / "fixtures" / "cluster_recording.jsonl"
DISAGG_RECORDING = Path(__file__).parent / "fixtures" / "disagg_recording.jsonl"


@pytest.fixture(scope="session")
def recording() -> list[dict]:
    return read_records(RECORDING)


@pytest.fixture
def recorded_state(recording: list[dict]) -> ClusterState:
    """The recorded cluster as it stood at the end of the recording (clock frozen there)."""
    return replay(recording)


@pytest.fixture(scope="session")
def disagg_recording() -> list[dict]:
    """A disaggregated cluster: 2 prefill + 3 decode workers moving KV (see make_recording.py)."""
    return read_records(DISAGG_RECORDING)


@pytest.fixture
def disagg_state(disagg_recording: list[dict]) -> ClusterState:
    return replay(disagg_recording)
