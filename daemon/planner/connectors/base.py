"""What every connector does: report how many ready workers each pool has, and move each pool
towards a desired count. Scale-down never loses a request (the worker is drained and its in-flight
work finishes or migrates before it stops); scale-up counts a worker only once it is ready."""

from __future__ import annotations

from typing import Protocol


class Connector(Protocol):
    name: str  # "local" | "ssh" | "virtual" | "kubernetes"

    async def start(self) -> None:
        """Connects to what it drives; raises ConfigError/DynamoError with an actionable message."""
        ...

    async def ready_replicas(self) -> dict[str, int]:
        """pool -> workers that are ready (registered in discovery and routable), as far as this
        connector can see."""
        ...

    async def set_replicas(self, desired: dict[str, int], decision_id: int) -> None:
        """Asks for ``desired`` (pool -> count). Returns once the request is accepted, not when
        reached; idempotent (the same counts again change nothing). Raises DynamoError when the
        request cannot be made."""
        ...

    async def close(self) -> None: ...
