"""The waiting queue: one order for new arrivals and preempted requests alike (chapters 04 and 06).

Requests wait in a heap ordered by (priority, arrival time, order of submission): under
`scheduling_policy="priority"` a lower priority value goes first, under the other policies
every request counts as priority 0, so the order is first come, first served. A preempted request
goes back by the same key, which puts it ahead of everyone who arrived after it — and, under
"priority", behind every waiting request that matters more (pushing it to the front instead
would let a low-priority request jump the queue).

Removal (an abort, or LPM admitting from the middle) marks the entry dead; the heap drops dead
entries when they reach the top. Every operation is O(log n) or better.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from minillm.request import Request


class WaitingQueue:
    def __init__(self, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        self._heap: list[list] = []  # [priority, arrival_time, seq, request, alive]
        self._entry_of: dict[str, list] = {}
        self._seq_of: dict[str, int] = {}  # a request keeps its place among equals when it returns
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._entry_of:
            raise RuntimeError(f"request {rid!r} is already waiting")
        seq = self._seq_of.setdefault(rid, next(self._counter))
        entry = [request.priority if self.by_priority else 0, request.arrival_time, seq, request, True]
        self._entry_of[rid] = entry
        heapq.heappush(self._heap, entry)

    def _drop_dead(self) -> None:
        while self._heap and not self._heap[0][4]:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._drop_dead()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        self._drop_dead()
        entry = heapq.heappop(self._heap)
        del self._entry_of[entry[3].request_id]
        return entry[3]

    def remove(self, request: Request) -> bool:
        """Take `request` out wherever it is; False if it was not waiting."""
        entry = self._entry_of.pop(request.request_id, None)
        if entry is None:
            return False
        entry[4] = False
        return True

    def forget(self, request: Request) -> None:
        """The request has left the engine: its place among equals is no longer needed."""
        self._seq_of.pop(request.request_id, None)

    def get(self, request_id: str) -> Request | None:
        entry = self._entry_of.get(request_id)
        return None if entry is None else entry[3]

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._entry_of

    def __len__(self) -> int:
        return len(self._entry_of)

    def __bool__(self) -> bool:
        return bool(self._entry_of)

    def head(self, k: int) -> list[Request]:
        """The first `k` requests in queue order, in O(n log k) (SplitFuse sizes each step by them)."""
        return [e[3] for e in heapq.nsmallest(k, self._entry_of.values())]

    def __iter__(self) -> Iterator[Request]:
        """In queue order (sorts: for inspection and LPM ranking, not for the hot path)."""
        return iter([e[3] for e in sorted(e for e in self._entry_of.values())])

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of the waiting queue ([0]) can be read directly")
        head = self.peek()
        if head is None:
            raise IndexError("the waiting queue is empty")
        return head
