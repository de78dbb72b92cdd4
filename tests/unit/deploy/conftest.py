"""The rendered overlays of deploy/kubernetes, shared by the manifest tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.kustomize_lite import render

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
OVERLAYS = ("agg", "disagg", "dev")

_rendered: dict[str, list[dict[str, Any]]] = {}


def rendered(overlay: str) -> list[dict[str, Any]]:
    if overlay not in _rendered:
        _rendered[overlay] = render(DEPLOY / "kubernetes" / "overlays" / overlay)
    return _rendered[overlay]


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param
