"""Token buckets per client: the request rate limit of the OpenAI port and the failed-auth limit
of every door (the frontend's routes, the status servers' ``/metrics``).

One bucket per client key, ``rate`` tokens a second up to ``burst``; ``acquire`` takes ``cost``
tokens or says how long until it could. A cost above the burst needs a full bucket and leaves it in
debt, so it is still paid at ``rate``. The table is bounded: past ``max_clients`` the buckets that
have refilled (idle clients, indistinguishable from new ones) are dropped first, so a scan from many
addresses costs memory only up to the bound.
"""

from __future__ import annotations

import time

from dynamod.shared.errors import ConfigError

DEFAULT_MAX_CLIENTS = 65536

DEFAULT_AUTH_FAILURE_RATE = 1.0
DEFAULT_AUTH_FAILURE_BURST = 10.0
"""Failed credential checks one address may make on a door: 10 at once, then one a second."""


class RateLimiter:
    """Token buckets per client key (see the module docstring)."""

    __slots__ = ("rate", "burst", "max_clients", "_buckets")

    def __init__(self, rate: float, burst: float | None = None, *, max_clients: int = DEFAULT_MAX_CLIENTS) -> None:
        if rate <= 0:
            raise ConfigError(f"--rate-limit must be above 0 requests/s to limit anything, got {rate}")
        burst = max(1.0, rate) if burst is None or burst <= 0 else burst
        if burst < 1:
            raise ConfigError(f"--rate-limit-burst must be at least 1 request, got {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_clients = max_clients
        self._buckets: dict[str, list[float]] = {}  # client -> [tokens, at]

    def acquire(self, client: str, now: float | None = None, *, cost: float = 1.0) -> float:
        """0.0 when ``client`` may go ahead (``cost`` tokens are taken), else the seconds until it
        may. A cost above the burst needs a full bucket and leaves it negative (module docstring)."""
        if now is None:
            now = time.monotonic()
        need = min(cost, self.burst)
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= self.max_clients:
                self._evict(now)
            bucket = self._buckets[client] = [self.burst, now]
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if tokens >= need:
            bucket[0] = tokens - cost
            return 0.0
        bucket[0] = tokens
        return (need - tokens) / self.rate

    def waiting(self, client: str, now: float | None = None) -> float:
        """Seconds until ``client`` has a whole token again (0.0: it has one); takes nothing."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return 0.0
        if now is None:
            now = time.monotonic()
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def _evict(self, now: float) -> None:
        full_after = self.burst / self.rate
        self._buckets = {k: b for k, b in self._buckets.items() if now - b[1] < full_after}
        if len(self._buckets) >= self.max_clients:
            # Every client is active: keep the newer half (dicts keep insertion order).
            keep = list(self._buckets.items())[self.max_clients // 2 :]
            self._buckets = dict(keep)

    def __len__(self) -> int:
        return len(self._buckets)
