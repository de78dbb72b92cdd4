"""Rates of cumulative counters, as workers publish them (bytes moved, blocks offloaded, ...).

A rate is taken over the last ``RATE_WINDOW_S`` of messages, on the publisher's own timestamps,
because load messages arrive once a second *and on change*: two messages 20 ms apart would
otherwise turn one event into a spike. A counter that goes backwards is a restarted worker: its
samples start again rather than giving a negative rate.
"""

from __future__ import annotations

from collections import deque

RATE_WINDOW_S = 5.0


class CounterRates:
    """(time, counters) samples of one publisher (one worker rank) and their rates per second."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples: deque[tuple[float, tuple[int, ...]]] = deque()

    def add(self, t: float, *counters: int) -> None:
        samples = self.samples
        if samples and any(now < before for now, before in zip(counters, samples[-1][1], strict=True)):
            samples.clear()  # the worker restarted: its counters began again
        if samples and t <= samples[-1][0]:
            return  # same instant (or out of order): nothing to learn about the rate
        samples.append((t, counters))
        while len(samples) > 2 and samples[1][0] <= t - RATE_WINDOW_S:
            samples.popleft()

    def rates(self) -> tuple[float, ...] | None:
        """Each counter's rate over the window; None until two samples."""
        if len(self.samples) < 2:
            return None
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        return tuple((b - a) / (t1 - t0) for a, b in zip(first, last, strict=True))
