"""The scheduler's waiting queue under its two policies, as vLLM's ``--scheduling-policy``.

``fcfs``: a deque; requests are admitted in arrival order and a request put back (preempted, its
remote or disk KV arrived) goes to the front.

``priority`` (vLLM's ``PriorityRequestQueue``): the request with the smallest ``(priority,
arrival)`` is admitted first, in the engine's convention (lower values first; the adapter turns
Dynamo's "higher is more urgent" into it, ``shared.protocol.llm.engine_priority``). Putting a
request back does not put it at the front: it takes its place by the same key, as vLLM's
``prepend_request`` on a priority queue does, so a preempted background request does not jump
ahead of an urgent one that arrived meanwhile.

Both expose the deque operations the scheduler uses, so its code is the same under either policy.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config imports the policy names; it must stay light (``--help``)
    from dynamod.daemon.engines.mocker.request import MockRequest

POLICY_FCFS = "fcfs"
POLICY_PRIORITY = "priority"
SCHEDULING_POLICIES = (POLICY_FCFS, POLICY_PRIORITY)


class PriorityRequestQueue:
    """A heap of waiting requests by ``(priority, arrival)``; ``[0]`` is the next to admit."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, MockRequest]] = []

    def append(self, request: MockRequest) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival, request))

    # A request put back takes its place by key, not the front (see the module docstring).
    appendleft = append

    def extendleft(self, requests: Iterable[MockRequest]) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> MockRequest:
        return heapq.heappop(self._heap)[2]

    def __getitem__(self, index: int) -> MockRequest:
        if index != 0:
            raise IndexError("a priority queue only shows its head")
        return self._heap[0][2]

    def remove(self, request: MockRequest) -> None:
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                last = self._heap.pop()
                if i < len(self._heap):
                    self._heap[i] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[MockRequest]:
        """In no particular order (heap order): the load report only sums over them."""
        return (entry[2] for entry in self._heap)

    def in_order(self) -> list[MockRequest]:
        """The waiting requests in admission order (a sort: for tests and diagnostics)."""
        return [entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1]))]


def create_request_queue(policy: str) -> deque[MockRequest] | PriorityRequestQueue:
    if policy == POLICY_FCFS:
        return deque()
    if policy == POLICY_PRIORITY:
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {', '.join(SCHEDULING_POLICIES)}")
