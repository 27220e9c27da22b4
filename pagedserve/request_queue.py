"""Waiting queues of the scheduling policies (vLLM's `request_queue.py`) and whom each preempts.

The scheduler admits waiting requests from the front of its queue and, when a running request
cannot get a block, preempts the running request its policy names (`select_victim`):

    policy    waiting order                          preempted first
    fcfs      arrival (a preempted request in front)  the newest running request
    priority  (priority, arrival): lower value first  the worst (priority, arrival) running

A preempted request goes back to the waiting queue: in front under fcfs, at its place by
(priority, arrival) under priority. Imports no torch.
"""

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from pagedserve.config import SCHEDULING_POLICIES
from pagedserve.request import Request


class RequestQueue:
    """The waiting requests in the order the scheduler admits them (base: first come, first
    served, a deque)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        """Queue a new request at its place (fcfs: the back)."""
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        """Return a request that was in the queue or running (a preempted one): fcfs puts it in
        front, ahead of every new request."""
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Return requests taken from the front (in their order) to where they were."""
        self._queue.extendleft(reversed(list(requests)))

    def peek_request(self) -> Request:
        """The next request to admit. Raises IndexError when the queue is empty."""
        return self._queue[0]

    def pop_request(self) -> Request:
        """Take the next request to admit. Raises IndexError when the queue is empty."""
        return self._queue.popleft()

    def remove_request(self, request: Request) -> None:
        """Drop a request (an abort). Raises ValueError when it is not queued."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        """The queued requests, in no particular order."""
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Waiting requests by (priority, arrival_time): a lower priority value is admitted first,
    ties by arrival, then by insertion (a heap, as vLLM's `PriorityRequestQueue`)."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # ties after arrival time; never compares Requests

    def add_request(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def prepend_request(self, request: Request) -> None:
        """A returning request goes to its place by (priority, arrival), like any other."""
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][3]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[3]

    def remove_request(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of a scheduling policy ("fcfs" or "priority"). Raises ValueError
    for another policy."""
    if policy == "fcfs":
        return RequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")


def select_victim(policy: str, running: list[Request]) -> Request:
    """The running request to preempt when blocks run out (`running` non-empty, oldest
    admitted first): fcfs the newest (the last); priority the one with the largest
    (priority, arrival_time), as vLLM V1's scheduler."""
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]
