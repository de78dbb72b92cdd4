"""Next-interval predictors for the SLA planner's load series (request rate, ISL, OSL).

Dynamo (``planner/core/load/predictors.py``) offers constant, ARIMA (pmdarima), Kalman (filterpy)
and Prophet; we keep constant and Kalman, fit ARIMA with statsmodels (already a maintained
dependency of the ``planner`` extra, where pmdarima would add a compiled one), and add a moving
average as the cheap middle ground. Behaviours kept from Dynamo: NaN counts as 0, zeros before the
first non-zero value are skipped (a planner started before traffic must not learn "idle" as the
level), each predictor answers the last value until it has enough points, and a failed fit falls
back to the last value instead of stopping the planner.

filterpy and statsmodels are imported only when their predictor is chosen; a missing one is a
``ConfigError`` that says which extra to install.
"""

from __future__ import annotations

import importlib
import logging
import math
import warnings
from collections import deque
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from dynamod.shared.errors import ConfigError

log = logging.getLogger(__name__)

PREDICTOR_KINDS = ("constant", "moving-average", "kalman", "arima")
ARIMA_MIN_POINTS = 5  # Dynamo's ARIMAPredictor minimum_data_points
ARIMA_MAX_POINTS = 200  # older points are dropped: the fit stays bounded in time
ARIMA_REFIT_EVERY = 10  # re-select the order every N new points; in between, extend the fit
ARIMA_ORDERS = ((1, 1, 1), (0, 1, 1), (1, 1, 0), (2, 1, 1), (1, 0, 0), (2, 0, 1))


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """Dynamo's defaults: ``load_predictor`` arima, ``kalman_q_level`` 1.0, ``kalman_q_trend`` 0.1,
    ``kalman_r`` 10.0, ``kalman_min_points`` 5, ``load_predictor_log1p`` off."""

    kind: str = "arima"
    log1p: bool = False
    window: int = 10  # moving average
    kalman_q_level: float = 1.0
    kalman_q_trend: float = 0.1
    kalman_r: float = 10.0
    kalman_min_points: int = 5

    def validate(self) -> PredictorConfig:
        if self.kind not in PREDICTOR_KINDS:
            raise ConfigError(f"unknown --load-predictor {self.kind!r}; choose one of {', '.join(PREDICTOR_KINDS)}")
        if self.window < 1:
            raise ConfigError(f"--prediction-window must be >= 1, got {self.window}")
        if self.kalman_min_points < 1:
            raise ConfigError(f"--kalman-min-points must be >= 1, got {self.kalman_min_points}")
        return self


class Predictor(Protocol):
    def add(self, value: float) -> None:
        """Record one interval's observed value."""
        ...

    def predict(self) -> float:
        """The next interval's value (>= 0); the last value, or 0, while there is too little data."""
        ...


def _import_optional(module: str, predictor: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"--load-predictor {predictor} needs the {module.split('.')[0]} package: "
            f"pip install 'dynamod[planner]' (or choose constant / moving-average)"
        ) from exc


class _Series:
    """The shared bookkeeping: NaN -> 0, leading idle zeros skipped, optional log1p transform."""

    def __init__(self, log1p: bool = False, maxlen: int | None = None) -> None:
        self.log1p = log1p
        self.raw: deque[float] = deque(maxlen=maxlen)
        self._seen_nonzero = False

    def accept(self, value: float) -> float | None:
        """The value to learn from, or None when it is skipped."""
        value = 0.0 if value is None or math.isnan(value) else max(0.0, float(value))
        if value == 0.0 and not self._seen_nonzero:
            return None
        self._seen_nonzero = self._seen_nonzero or value != 0.0
        self.raw.append(value)
        return math.log1p(value) if self.log1p else value

    def last(self) -> float:
        return self.raw[-1] if self.raw else 0.0

    def back(self, y: float) -> float:
        return max(0.0, math.expm1(y) if self.log1p else y)


class ConstantPredictor:
    """Next = last. Dynamo's ``ConstantPredictor``."""

    def __init__(self) -> None:
        self._series = _Series()

    def add(self, value: float) -> None:
        self._series.accept(value)

    def predict(self) -> float:
        return self._series.last()


class MovingAveragePredictor:
    """Next = mean of the last ``window`` values: smooths noise, lags a trend by window/2."""

    def __init__(self, window: int = 10) -> None:
        self._series = _Series(maxlen=window)

    def add(self, value: float) -> None:
        self._series.accept(value)

    def predict(self) -> float:
        raw = self._series.raw
        return sum(raw) / len(raw) if raw else 0.0


class KalmanPredictor:
    """Local linear trend (level + slope) Kalman filter, filterpy's ``KalmanFilter``, as Dynamo's:
    ``F = [[1, 1], [0, 1]]``, ``H = [1, 0]``, ``Q = diag(q_level, q_trend)``, ``R = r``,
    ``P0 = 1000 I``. Predicts one step ahead of the last update."""

    def __init__(self, q_level: float = 1.0, q_trend: float = 0.1, r: float = 10.0,
                 min_points: int = 5, log1p: bool = False) -> None:
        np = _import_optional("numpy", "kalman")
        kalman = _import_optional("filterpy.kalman", "kalman")
        self._np = np
        self._series = _Series(log1p=log1p)
        self._min_points = min_points
        kf = kalman.KalmanFilter(dim_x=2, dim_z=1)
        kf.x = np.zeros((2, 1))
        kf.F = np.array([[1.0, 1.0], [0.0, 1.0]])
        kf.H = np.array([[1.0, 0.0]])
        kf.P *= 1000.0
        kf.R = np.array([[max(1e-9, r)]])
        kf.Q = np.array([[max(1e-12, q_level), 0.0], [0.0, max(1e-12, q_trend)]])
        self._kf = kf
        self._count = 0

    def add(self, value: float) -> None:
        z = self._series.accept(value)
        if z is None:
            return
        if self._count == 0:
            self._kf.x = self._np.array([[z], [0.0]])
        else:
            self._kf.predict()
            self._kf.update(self._np.array([[z]]))
        self._count += 1

    def predict(self) -> float:
        if self._count < self._min_points:
            return self._series.last()
        x = self._kf.F @ self._kf.x  # one step ahead, without disturbing the filter
        return self._series.back(float(x[0, 0]))


class ArimaPredictor:
    """ARIMA from statsmodels. The order is chosen by AIC from a small grid when there are enough
    points (Dynamo's auto_arima does the same search, wider) and re-chosen every
    ``ARIMA_REFIT_EVERY`` points; between refits new points extend the fitted model without
    re-estimating it, which keeps a planner interval cheap."""

    def __init__(self, log1p: bool = False) -> None:
        self._sm = _import_optional("statsmodels.tsa.arima.model", "arima")
        self._series = _Series(log1p=log1p, maxlen=ARIMA_MAX_POINTS)
        self._y: deque[float] = deque(maxlen=ARIMA_MAX_POINTS)
        self._result: Any = None
        self._since_fit = 0
        self._pending: list[float] = []

    def add(self, value: float) -> None:
        y = self._series.accept(value)
        if y is None:
            return
        self._y.append(y)
        self._pending.append(y)
        self._since_fit += 1

    def _fit(self) -> None:
        best, best_aic = None, math.inf
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for order in ARIMA_ORDERS:
                try:
                    res = self._sm.ARIMA(list(self._y), order=order).fit()
                except Exception:  # noqa: BLE001 - a failed order is skipped, others remain
                    continue
                if math.isfinite(res.aic) and res.aic < best_aic:
                    best, best_aic = res, res.aic
        self._result = best
        self._since_fit = 0
        self._pending = []

    def predict(self) -> float:
        if len(self._y) < ARIMA_MIN_POINTS:
            return self._series.last()
        if len(set(self._y)) == 1:
            return self._series.last()
        try:
            if self._result is None or self._since_fit >= ARIMA_REFIT_EVERY:
                self._fit()
            elif self._pending:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._result = self._result.append(self._pending, refit=False)
                self._pending = []
            if self._result is None:
                return self._series.last()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                forecast = float(self._result.forecast(1)[0])
            if not math.isfinite(forecast):
                return self._series.last()
            return self._series.back(forecast)
        except Exception as exc:  # noqa: BLE001 - Dynamo: a failed prediction falls back to the last value
            log.warning("arima prediction failed, using the last value: %s", exc)
            self._result = None
            return self._series.last()


def make_predictor(config: PredictorConfig) -> Predictor:
    """A fresh predictor of the configured kind (one per predicted series)."""
    config.validate()
    if config.kind == "constant":
        return ConstantPredictor()
    if config.kind == "moving-average":
        return MovingAveragePredictor(config.window)
    if config.kind == "kalman":
        return KalmanPredictor(config.kalman_q_level, config.kalman_q_trend, config.kalman_r,
                               config.kalman_min_points, config.log1p)
    return ArimaPredictor(config.log1p)
