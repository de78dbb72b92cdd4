"""When a pool may shrink: hysteresis derived from the workers' start-up time.

A worker released now costs ``startup_s`` (paid for, serving nothing) to bring back, so a planner
that follows every dip pays start-ups and misses the SLA while they run. ``ScaleGuard`` keeps, per
pool, the replicas each interval needed (the capacity model's answer for that interval's demand,
which already counts the whole pool's load, so survivors carrying ``N / (N - 1)`` of it is built in)
and answers:

- up at once to what the interval needs (a backlog is sized whole, not one worker per interval);
- down only to a high quantile (90%) of what the intervals of the last ``window_s`` (a multiple
  of the start-up time) needed for a sustained rate: the fleet releases slowly, sized to the recent peak. A queue to
  clear is not remembered: the workers a backlog brought go once it is cleared and they served;
- never while a scale-up is still starting, nor before its workers have been ready and served for
  one interval (their first interval is cold: they had no work yet, so the pool looks idle);
- "no traffic" is a need like any other (the minimum), so an idle pool goes to its minimum after
  the window instead of holding for want of a measurement.

Pure: the caller's clock (``now``) and its observations in, a decision out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dynamod.shared.stats import nearest_rank


@dataclass(frozen=True, slots=True)
class GuardDecision:
    desired: int
    held: bool  # a smaller need was refused by the guard
    reason: str  # the guard's reason when it held ("" when it did not)
    detail: str
    window_need: int  # the most any interval of the window needed


@dataclass(slots=True)
class _PoolHistory:
    needs: deque[tuple[float, int]] = field(default_factory=deque)
    first_at: float = float("inf")  # the first decision seen
    grew_at: float = float("-inf")  # when the pool was last asked to grow
    grew_to: int = 0
    settled_at: float | None = float("-inf")  # when ready first reached ``grew_to`` (None: not yet)


class ScaleGuard:
    def __init__(self, *, window_s: float, interval_s: float, quantile: float = 0.9) -> None:
        self.window_s = window_s
        self.interval_s = interval_s
        self.quantile = quantile
        self._pools: dict[str, _PoolHistory] = {}

    def decide(self, pool: str, *, now: float, ready: int, committed: int, need: int,
               evidence: int | None = None) -> GuardDecision:
        """``committed``: the replicas asked for and not given up (ready + starting, or the last
        target while it is pending); ``need``: what this interval needs (already within the
        pool's bounds); ``evidence``: the part of it that is sustained (a rate, not a queue to
        clear), which the release window remembers (default: all of ``need``). It may exceed
        ``need`` (a burst onset's carried rate, ``reactive.Need.hold_only``): remembered, it
        holds the pool later, it never grows it (only ``need`` does)."""
        h = self._pools.setdefault(pool, _PoolHistory())
        h.first_at = min(h.first_at, now)
        h.needs.append((now, need if evidence is None else evidence))
        while h.needs and h.needs[0][0] < now - self.window_s:
            h.needs.popleft()
        # Nearest rank, an observed count: a high quantile, not the max, so one noisy interval in
        # a window does not hold a worker for the whole window, while a burst that filled more than
        # a tenth of it (at the default 0.9) does.
        window_need = nearest_rank((n for _, n in h.needs), self.quantile)
        if h.settled_at is None and ready >= h.grew_to:
            h.settled_at = now
        if need > committed:
            h.grew_at, h.grew_to, h.settled_at = now, need, None
            return GuardDecision(need, False, "", "", window_need)
        if need == committed:
            return GuardDecision(committed, False, "", "", window_need)
        if ready < committed:
            return GuardDecision(committed, True, "scale_up_in_progress",
                                 f"{committed - ready} of {committed} still starting: a scale-up is never undone "
                                 "before its workers served", window_need)
        if h.settled_at is None or now - h.settled_at < self.interval_s:
            return GuardDecision(committed, True, "scale_up_settling",
                                 f"new workers ready since {0 if h.settled_at is None else now - h.settled_at:.0f}s: "
                                 f"they serve one interval ({self.interval_s:g}s) before the pool may shrink",
                                 window_need)
        # Evidence over the window (each need covers the interval that ended with it). A planner
        # just started has less: a third of the window (two start-up times by default) will do
        # then, or a fleet sized for a cold start's backlog would be paid for a whole window.
        observed = now - h.first_at + self.interval_s
        if observed < min(self.window_s, max(self.window_s / 3.0, 2 * self.interval_s)):
            return GuardDecision(committed, True, "release_window",
                                 f"{need} would do now; shrinking needs {self.window_s:g}s of evidence, have {observed:.0f}s",
                                 window_need)
        target = max(window_need, need)
        if target >= committed:
            return GuardDecision(committed, True, "release_window",
                                 f"{need} would do now, but {window_need} were needed within the last {self.window_s:g}s",
                                 window_need)
        return GuardDecision(target, False, "", f"the last {self.window_s:g}s never needed more than {window_need}",
                             window_need)

    def forget(self, pool: str) -> None:
        self._pools.pop(pool, None)
