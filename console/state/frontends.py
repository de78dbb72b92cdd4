"""Frontend scrapes: the recent ``/metrics`` readings of each frontend, and per-model figures from them.

A frontend's counters and histograms are cumulative since it started; the Models view wants rates
and percentiles over the last minute. Each source keeps a short ring of timestamped scrapes, and a
figure is the difference between the newest and the oldest one in the window, summed over
frontends. A counter that went backwards (a restarted frontend) or an idle window falls back to
lifetime figures rather than showing nothing.
"""

from __future__ import annotations

from collections import deque

from dynamod.console.state import histogram
from dynamod.console.state.prom import FrontendScrape
from dynamod.console.state.records import ModelStats
from dynamod.console.state.versions import Versions

LATENCY_WINDOW_S = 60.0
MAX_SCRAPES_PER_SOURCE = 64


class FrontendScrapes:
    """A ring of (time, scrape) per metrics source, trimmed to the window."""

    def __init__(self, versions: Versions) -> None:
        self._versions = versions
        self._rings: dict[str, deque[tuple[float, FrontendScrape]]] = {}
        self.problems: dict[str, str] = {}  # source -> why its last scrape gave nothing

    def add(self, source: str, scrape: FrontendScrape, now: float) -> None:
        ring = self._rings.setdefault(source, deque(maxlen=MAX_SCRAPES_PER_SOURCE))
        ring.append((now, scrape))
        self.problems.pop(source, None)
        while len(ring) > 2 and now - ring[1][0] > LATENCY_WINDOW_S:
            ring.popleft()
        self._versions.models += 1

    def forget(self, source: str) -> None:
        """The source is no longer scraped: its figures stop counting."""
        had_problem = self.problems.pop(source, None) is not None
        if self._rings.pop(source, None) is not None or had_problem:
            self._versions.models += 1

    def failed(self, source: str, reason: str) -> None:
        """The source answered with no figures (refused, unreachable): they stop counting, and the
        reason is kept for the views to show where a figure would be."""
        self._rings.pop(source, None)
        self.problems[source] = reason
        self._versions.models += 1

    @property
    def sources(self) -> list[str]:
        return sorted(self._rings)

    def model_stats(self) -> dict[str, ModelStats]:
        """Per model over the recent window, summed across frontends."""
        out: dict[str, ModelStats] = {}
        ttft: dict[str, dict[float, float]] = {}
        itl: dict[str, dict[float, float]] = {}
        tokens: dict[str, list[float]] = {}  # model -> [cached, prompt] over the window
        for ring in self._rings.values():
            t1, newest = ring[-1]
            t0, oldest = ring[0]
            for model in newest.models:
                st = out.setdefault(model, ModelStats())
                total = newest.requests.get(model, 0.0)
                st.requests_total += total
                st.errors_total += newest.errors.get(model, 0.0)
                st.migrations_total += newest.migrations.get(model, 0.0)
                st.inflight += newest.inflight.get(model, 0.0)
                if t1 > t0:
                    before = oldest.requests.get(model, 0.0)
                    delta = total - before if total >= before else total
                    st.request_rate = (st.request_rate or 0.0) + delta / (t1 - t0)
                prompt = newest.prompt_tokens.get(model, 0.0)
                cached = newest.cached_tokens.get(model, 0.0)
                d_prompt = prompt - oldest.prompt_tokens.get(model, 0.0)
                d_cached = cached - oldest.cached_tokens.get(model, 0.0)
                if t1 <= t0 or d_prompt <= 0 or d_cached < 0:
                    d_prompt, d_cached = prompt, cached  # idle window or a restart: lifetime figures
                acc = tokens.setdefault(model, [0.0, 0.0])
                acc[0] += d_cached
                acc[1] += d_prompt
                for src, dst in ((newest.ttft, ttft), (newest.itl, itl)):
                    buckets = src.get(model)
                    if not buckets:
                        continue
                    older = (oldest.ttft if src is newest.ttft else oldest.itl).get(model)
                    recent = histogram.subtract(buckets, older) if older is not None and t1 > t0 else dict(buckets)
                    if not any(recent.values()):
                        recent = dict(buckets)  # idle window: show the lifetime figures instead of nothing
                    histogram.add(dst.setdefault(model, {}), recent)
        for model, st in out.items():
            cached_sum, prompt_sum = tokens.get(model, (0.0, 0.0))
            if prompt_sum > 0:
                st.hit_rate = cached_sum / prompt_sum
            if model in ttft:
                st.ttft_p50, st.ttft_p99 = histogram.percentiles(ttft[model])
            if model in itl:
                st.itl_p50, st.itl_p99 = histogram.percentiles(itl[model])
        return out
