"""Fixtures the engine adapters' tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.engines.test_vllm_support import build_tiny_model


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    """A tiny Llama checkpoint on disk, for the end-to-end tests that run where the engine is installed."""
    build_tiny_model(tmp_path / "m")
    return tmp_path / "m"
