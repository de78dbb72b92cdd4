"""The bounded in-memory store behind ``previous_response_id`` and ``GET /v1/responses/{id}``.

Each stored response keeps only its own turn (the input messages it was sent, without its
instructions, and its output as assistant/tool-call messages) and the id of the response it
followed, so a long conversation costs memory in proportion to its length, not to its square.
The history of a turn is rebuilt by walking that chain back.

Bounded by a number of responses (``--responses-store-size``), least recently used first out;
reading a conversation touches every turn of it, so a conversation in use keeps its early turns.
A chain with an evicted turn can no longer be continued: the client gets a 400 that says so,
never a silently shortened history. The store lives in one frontend process: with several
frontends behind one port (``--num-frontends``) or a load balancer, a follow-up request must reach
the frontend that answered the first, or send its history itself (``input`` items).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from dynamod.shared.errors import InvalidRequestError, NotFoundError

DEFAULT_STORE_SIZE = 1024
MAX_CHAIN = 10_000  # a guard against a cycle, which ids from uuid4 cannot form


class PreviousResponseNotFoundError(InvalidRequestError):
    code = "previous_response_not_found"


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    messages: list[dict[str, Any]]  # this turn: its input messages, then its output as messages
    previous_id: str | None


class ResponseStore:
    """Up to ``capacity`` responses by id; ``capacity`` 0 keeps none."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE) -> None:
        if capacity < 0:
            raise ValueError(f"the response store size must be 0 or more, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = entry
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """One stored response (``NotFoundError`` when not kept)."""
        entry = self._items.get(response_id)
        if entry is None:
            raise NotFoundError(f"no response with id {response_id!r} is stored here ({self._where()})")
        self._items.move_to_end(response_id)
        return entry

    def history(self, previous_id: str) -> list[dict[str, Any]]:
        """The messages of every turn up to and including ``previous_id``, oldest first."""
        if self.capacity == 0:
            raise PreviousResponseNotFoundError(
                "previous_response_id is not available: this frontend keeps no responses (--responses-store-size 0); "
                "send the conversation in 'input' instead",
                param="previous_response_id",
            )
        chain: list[str] = []  # newest first
        current: str | None = previous_id
        while current is not None and len(chain) < MAX_CHAIN:
            entry = self._items.get(current)
            if entry is None:
                lost = "" if current == previous_id else f" (its earlier turn {current!r} is no longer kept)"
                raise PreviousResponseNotFoundError(
                    f"previous response {previous_id!r} cannot be continued{lost}: {self._where()}; "
                    "send the conversation in 'input' instead",
                    param="previous_response_id",
                )
            chain.append(current)
            current = entry.previous_id
        messages: list[dict[str, Any]] = []
        for response_id in reversed(chain):  # oldest first: the newest turn ends most recently used
            self._items.move_to_end(response_id)
            messages.extend(self._items[response_id].messages)
        return messages

    def delete(self, response_id: str) -> None:
        if self._items.pop(response_id, None) is None:
            raise NotFoundError(f"no response with id {response_id!r} is stored here ({self._where()})")

    def _where(self) -> str:
        return (
            f"this frontend process keeps its last {self.capacity} responses in memory, and only those it answered "
            "with 'store' on"
        )
