"""Change counters per area of the cluster picture.

Each manager behind ``ClusterState`` bumps the counter of the area it owns; a screen compares the
counters it drew with against the current ones and redraws only what changed, which keeps a
256-worker cluster at ten updates a second cheap to show.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Versions:
    topology: int = 0  # instances, workers, cards
    load: int = 0  # load metrics, KV events, latencies
    events: int = 0
    decisions: int = 0
    models: int = 0  # frontend scrapes
    connection: int = 0
    scaling: int = 0  # planner decisions, status, overrides
    requests: int = 0  # the frontends' slowest recent requests (Requests view)

    def total(self) -> int:
        return (self.topology + self.load + self.events + self.decisions + self.models + self.connection + self.scaling
                + self.requests)
