"""Console test fixtures: the recorded cluster picture, replayed with its own (frozen) clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import read_records, replay

RECORDING = Path(__file__).parent / "fixtures" / "cluster_recording.jsonl"


@pytest.fixture(scope="session")
def recording() -> list[dict]:
    return read_records(RECORDING)


@pytest.fixture
def recorded_state(recording: list[dict]) -> ClusterState:
    """The recorded cluster as it stood at the end of the recording (clock frozen there)."""
    return replay(recording)
