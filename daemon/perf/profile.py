"""The performance profile the SLA planner sizes pools from: measured tables and their interpolation.

Dynamo's profiler (``profiler/profile_sla.py``, ``profiler/interpolation.py``) writes two tables per
engine configuration and the planner interpolates them (``planner/utils/perf_interpolation.py`` in
the 0.x releases):

- prefill: TTFT (ms) and prefill throughput per GPU (prompt tokens/s/GPU) against input length;
- decode: ITL (ms) and decode throughput per GPU (output tokens/s/GPU) against KV usage (0..1 of the
  engine's KV capacity) and context length.

Here the decode table is kept as rows, one per context length, each a list of points sorted by KV
usage; a query interpolates linearly inside the two rows around the context length and then between
them. Queries outside the measured range are clamped to its edge (a profile never extrapolates:
an engine past its largest measured batch is not known to get faster). Pure Python: a table has tens
of points and is read a few times per planner interval.

File format (JSON): ``{"schema_version": 1, "kind": "dynamod.perf_profile", "engine": ...,
"settings": {...}, "prefill": {"engine_num_gpu", "isl", "ttft_ms", "thpt_per_gpu"}, "decode":
{"engine_num_gpu", "max_kv_tokens", "rows": [{"context_length", "kv_usage", "itl_ms",
"thpt_per_gpu"}]}}``. A bad file is a ``ProfileError`` naming the file and the field.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from dynamod.shared.errors import ConfigError

SCHEMA_VERSION = 1
PROFILE_KIND = "dynamod.perf_profile"
BEST_THROUGHPUT_STEPS = 200  # KV-usage steps scanned for the best throughput under an ITL target


class ProfileError(ConfigError):
    """A profile file that is missing, unreadable or not a valid profile."""

    code = "profile_error"


def default_profile_path() -> str:
    """The mocker profile shipped in the package (``dynamod profile`` with default flags)."""
    return str(resources.files("dynamod.daemon") / "assets" / "profiles" / "mocker.json")


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation on increasing ``xs``, clamped to the end values."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    t = (x - x0) / (x1 - x0)
    return float(ys[i - 1] + t * (ys[i] - ys[i - 1]))


def _floats(section: dict[str, Any], name: str, where: str) -> list[float]:
    value = section.get(name)
    if not isinstance(value, list) or not value:
        raise ProfileError(f"{where}.{name}: expected a non-empty list of numbers")
    try:
        out = [float(v) for v in value]
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{where}.{name}: expected numbers ({exc})") from exc
    if not all(math.isfinite(v) and v >= 0 for v in out):
        raise ProfileError(f"{where}.{name}: values must be finite and >= 0")
    return out


def _increasing(values: list[float], where: str) -> None:
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ProfileError(f"{where}: must be strictly increasing, got {values}")


@dataclass(slots=True)
class PrefillTable:
    isl: list[float]
    ttft_ms: list[float]
    thpt_per_gpu: list[float]  # prompt tokens / s / GPU
    engine_num_gpu: int = 1

    def validate(self, where: str = "prefill") -> PrefillTable:
        if not (len(self.isl) == len(self.ttft_ms) == len(self.thpt_per_gpu)) or not self.isl:
            raise ProfileError(f"{where}: isl, ttft_ms and thpt_per_gpu must be non-empty and of one length")
        _increasing(self.isl, f"{where}.isl")
        if any(v <= 0 for v in self.thpt_per_gpu):
            raise ProfileError(f"{where}.thpt_per_gpu: must be > 0")
        if self.engine_num_gpu < 1:
            raise ProfileError(f"{where}.engine_num_gpu: must be >= 1")
        return self

    def ttft(self, isl: float) -> float:
        return _interp(self.isl, self.ttft_ms, isl)

    def throughput_per_gpu(self, isl: float) -> float:
        return _interp(self.isl, self.thpt_per_gpu, isl)


@dataclass(slots=True)
class DecodeRow:
    context_length: float
    kv_usage: list[float]
    itl_ms: list[float]
    thpt_per_gpu: list[float]  # output tokens / s / GPU


@dataclass(slots=True)
class DecodeTable:
    rows: list[DecodeRow]
    max_kv_tokens: int  # KV capacity of one engine, to turn a concurrency into a KV usage
    engine_num_gpu: int = 1
    _contexts: list[float] = field(default_factory=list, repr=False)

    def validate(self, where: str = "decode") -> DecodeTable:
        if not self.rows:
            raise ProfileError(f"{where}.rows: expected at least one context length")
        if self.max_kv_tokens <= 0:
            raise ProfileError(f"{where}.max_kv_tokens: must be > 0")
        if self.engine_num_gpu < 1:
            raise ProfileError(f"{where}.engine_num_gpu: must be >= 1")
        self._contexts = [r.context_length for r in self.rows]
        _increasing(self._contexts, f"{where}.rows[].context_length")
        for i, r in enumerate(self.rows):
            w = f"{where}.rows[{i}]"
            if not (len(r.kv_usage) == len(r.itl_ms) == len(r.thpt_per_gpu)) or not r.kv_usage:
                raise ProfileError(f"{w}: kv_usage, itl_ms and thpt_per_gpu must be non-empty and of one length")
            _increasing(r.kv_usage, f"{w}.kv_usage")
            if any(v <= 0 for v in r.thpt_per_gpu):
                raise ProfileError(f"{w}.thpt_per_gpu: must be > 0")
        return self

    def _between(self, context_length: float) -> tuple[DecodeRow, DecodeRow, float]:
        cs = self._contexts or [r.context_length for r in self.rows]
        if context_length <= cs[0]:
            return self.rows[0], self.rows[0], 0.0
        if context_length >= cs[-1]:
            return self.rows[-1], self.rows[-1], 0.0
        i = bisect.bisect_right(cs, context_length)
        t = (context_length - cs[i - 1]) / (cs[i] - cs[i - 1])
        return self.rows[i - 1], self.rows[i], t

    def _value(self, attr: str, kv_usage: float, context_length: float) -> float:
        lo, hi, t = self._between(context_length)
        a = _interp(lo.kv_usage, getattr(lo, attr), kv_usage)
        b = _interp(hi.kv_usage, getattr(hi, attr), kv_usage)
        return a + t * (b - a)

    def itl(self, kv_usage: float, context_length: float) -> float:
        return self._value("itl_ms", kv_usage, context_length)

    def throughput_per_gpu(self, kv_usage: float, context_length: float) -> float:
        return self._value("thpt_per_gpu", kv_usage, context_length)

    def kv_usage_for(self, concurrency: float, context_length: float) -> float:
        """KV usage of ``concurrency`` sequences of ``context_length`` tokens on one engine."""
        return concurrency * context_length / self.max_kv_tokens

    def itl_at_concurrency(self, concurrency: float, context_length: float) -> float:
        return self.itl(self.kv_usage_for(concurrency, context_length), context_length)

    def max_kv_usage(self, context_length: float) -> float:
        lo, hi, t = self._between(context_length)
        return lo.kv_usage[-1] + t * (hi.kv_usage[-1] - lo.kv_usage[-1])

    def best_throughput_per_gpu(self, itl_ms: float, context_length: float) -> tuple[float, float, float]:
        """(throughput per GPU, KV usage, ITL) at the KV usage with the highest throughput whose
        ITL stays within ``itl_ms``: how hard one decode engine can be driven under the target.
        When even the lightest measured load misses it, the lightest load's figures (Dynamo does
        the same and warns)."""
        top = self.max_kv_usage(context_length)
        lo, _, _ = self._between(context_length)
        start = lo.kv_usage[0]
        best: tuple[float, float, float] | None = None
        for k in range(BEST_THROUGHPUT_STEPS + 1):
            u = start + (top - start) * k / BEST_THROUGHPUT_STEPS
            itl = self.itl(u, context_length)
            if itl <= itl_ms:
                thpt = self.throughput_per_gpu(u, context_length)
                if best is None or thpt > best[0]:
                    best = (thpt, u, itl)
        if best is None:
            return self.throughput_per_gpu(start, context_length), start, self.itl(start, context_length)
        return best


@dataclass(slots=True)
class PerfProfile:
    prefill: PrefillTable
    decode: DecodeTable
    engine: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the file it was read from

    def validate(self) -> PerfProfile:
        self.prefill.validate()
        self.decode.validate()
        return self

    # ---- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": PROFILE_KIND,
            "engine": self.engine,
            "settings": self.settings,
            "prefill": {
                "engine_num_gpu": self.prefill.engine_num_gpu,
                "isl": self.prefill.isl,
                "ttft_ms": self.prefill.ttft_ms,
                "thpt_per_gpu": self.prefill.thpt_per_gpu,
            },
            "decode": {
                "engine_num_gpu": self.decode.engine_num_gpu,
                "max_kv_tokens": self.decode.max_kv_tokens,
                "rows": [
                    {"context_length": r.context_length, "kv_usage": r.kv_usage, "itl_ms": r.itl_ms,
                     "thpt_per_gpu": r.thpt_per_gpu}
                    for r in self.decode.rows
                ],
            },
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "") -> PerfProfile:
        where = source or "profile"
        try:
            return cls._from_json(data, source)
        except ProfileError as exc:
            raise ProfileError(f"{where}: {exc}") from None

    @classmethod
    def _from_json(cls, data: Any, source: str) -> PerfProfile:
        if not isinstance(data, dict):
            raise ProfileError("expected a JSON object")
        if data.get("kind") != PROFILE_KIND:
            raise ProfileError(f"not a dynamod performance profile (kind {data.get('kind')!r}, want {PROFILE_KIND!r})")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(
                f"schema_version {version!r} is not supported (this dynamod reads {SCHEMA_VERSION}); "
                "re-run `dynamod profile`")
        p = data.get("prefill")
        d = data.get("decode")
        if not isinstance(p, dict):
            raise ProfileError("prefill: missing or not an object")
        if not isinstance(d, dict):
            raise ProfileError("decode: missing or not an object")
        prefill = PrefillTable(_floats(p, "isl", "prefill"), _floats(p, "ttft_ms", "prefill"),
                               _floats(p, "thpt_per_gpu", "prefill"), int(p.get("engine_num_gpu", 1)))
        rows_raw = d.get("rows")
        if not isinstance(rows_raw, list):
            raise ProfileError("decode.rows: expected a list")
        rows = []
        for i, r in enumerate(rows_raw):
            w = f"decode.rows[{i}]"
            if not isinstance(r, dict) or not isinstance(r.get("context_length"), int | float):
                raise ProfileError(f"{w}: expected an object with a numeric context_length")
            rows.append(DecodeRow(float(r["context_length"]), _floats(r, "kv_usage", w), _floats(r, "itl_ms", w),
                                  _floats(r, "thpt_per_gpu", w)))
        max_kv = d.get("max_kv_tokens")
        if not isinstance(max_kv, int | float):
            raise ProfileError("decode.max_kv_tokens: expected a number")
        decode = DecodeTable(rows, int(max_kv), int(d.get("engine_num_gpu", 1)))
        settings = data.get("settings") or {}
        return cls(prefill, decode, str(data.get("engine", "")), dict(settings), source).validate()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PerfProfile:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ProfileError(f"profile {path} not found; write one with `dynamod profile --output {path}`") from None
        except OSError as exc:
            raise ProfileError(f"profile {path}: cannot read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {path}: not JSON: {exc}") from None
        return cls.from_json(data, str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes atomically (temp file, then rename) so a reader never sees half a profile."""
        self.validate()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
