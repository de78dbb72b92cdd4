"""Each predictor on a series whose next value is obvious."""

from __future__ import annotations

import pytest

from dynamod.daemon.planner import predictors
from dynamod.daemon.planner.predictors import (
    ArimaPredictor,
    ConstantPredictor,
    KalmanPredictor,
    MovingAveragePredictor,
    PredictorConfig,
    make_predictor,
)
from dynamod.shared.errors import ConfigError


def feed(p, values):  # type: ignore[no-untyped-def]
    for v in values:
        p.add(v)
    return p.predict()


def test_constant_is_last_and_skips_leading_idle() -> None:
    assert feed(ConstantPredictor(), [0, 0, 3, 5]) == 5
    assert feed(ConstantPredictor(), [float("nan")]) == 0.0


def test_moving_average_window() -> None:
    assert feed(MovingAveragePredictor(window=3), [0, 1, 2, 3, 4]) == pytest.approx(3.0)
    ma = MovingAveragePredictor(window=3)
    feed(ma, [0, 0])  # idle start is not learned as the level
    assert feed(ma, [6]) == 6


def test_kalman_follows_a_trend() -> None:
    k = KalmanPredictor(min_points=5)
    assert feed(k, [10, 12]) == 12  # too few points: the last value
    assert feed(k, [14, 16, 18, 20, 22, 24, 26, 28]) == pytest.approx(30, abs=1.5)


def test_arima_follows_a_trend_and_a_constant() -> None:
    a = ArimaPredictor()
    assert feed(a, [5, 5, 5]) == 5  # under the minimum points
    assert feed(ArimaPredictor(), [7] * 8) == 7
    assert feed(ArimaPredictor(), [float(2 * i) for i in range(1, 21)]) == pytest.approx(42, abs=2)


def test_factory_and_missing_library(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_predictor(PredictorConfig(kind="moving-average", window=2)), MovingAveragePredictor)
    with pytest.raises(ConfigError, match="--load-predictor"):
        PredictorConfig(kind="prophet").validate()
    import importlib

    real = importlib.import_module

    def no_filterpy(name: str, *args: object) -> object:
        if name.startswith("filterpy"):
            raise ImportError(name)
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(predictors.importlib, "import_module", no_filterpy)
    with pytest.raises(ConfigError, match=r"dynamod\[planner\]"):
        make_predictor(PredictorConfig(kind="kalman"))
