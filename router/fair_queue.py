"""The admission queue's order: weighted fair queuing between clients (start-time fair queuing).

Each client (an API key, the ``x-splitserve-client`` metadata or header, else its host) has a
virtual time: the prompt tokens of its requests let go so far, divided by its weight
(``--client-weights``, 1 by default). The head of the queue is the oldest waiter of the waiting
client with the least virtual time, so a client's burst queues behind itself and every client
gets its weight's share of what the pools let go. A client that starts waiting again begins at
the queue's virtual time (the work let go so far per weight of the clients waiting), not where
it left off: idle time earns no credit. One client alone: arrival order, as a plain queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    client: str
    cost: int  # prompt tokens it will have computed: its share of the pools
    since: float


W = TypeVar("W", bound=Queued)


class FairQueue(Generic[W]):
    """Waiters by client; ``head`` is the next to go (see the module doc)."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        self._queues: dict[str, deque[W]] = {}  # clients with waiters, each in arrival order
        self._vtime: dict[str, float] = {}  # client → service per weight (active clients)
        self._now = 0.0  # the queue's virtual time (see let_go)
        # NOTE: every waiter in arrival order too: the metrics thread reads snapshots of it
        # (tuple() of a deque is one C-level copy) while the event loop changes the rest.
        self.all: deque[W] = deque()

    def __len__(self) -> int:
        return len(self.all)

    def weight(self, client: str) -> float:
        return self._weights.get(client, 1.0)

    def append(self, waiter: W) -> None:
        queue = self._queues.get(waiter.client)
        if queue is None:
            queue = self._queues[waiter.client] = deque()
            self._vtime[waiter.client] = max(self._vtime.get(waiter.client, 0.0), self._now)
        queue.append(waiter)
        self.all.append(waiter)

    def remove(self, waiter: W) -> None:
        queue = self._queues[waiter.client]
        queue.remove(waiter)
        self.all.remove(waiter)
        if not queue:
            del self._queues[waiter.client]
            # Kept while it is ahead of the queue's time (it may not come back earlier); a
            # client behind it would start at the queue's time anyway.
            if self._vtime[waiter.client] <= self._now:
                del self._vtime[waiter.client]

    def head(self) -> W | None:
        """The waiter to go next: the oldest of the client with the least virtual time."""
        if not self._queues:
            return None
        client = min(self._queues, key=lambda c: (self._vtime[c], self._queues[c][0].since))
        return self._queues[client][0]

    def let_go(self, waiter: W) -> None:
        """``waiter`` (the head) goes to the pools: charge its client (then ``remove`` it)."""
        start = self._vtime[waiter.client]
        cost = max(waiter.cost, 1)
        self._vtime[waiter.client] = start + cost / self.weight(waiter.client)
        # The queue's time advances as fair queuing's would: by the work let go over the weight
        # of the clients waiting, and never behind the least of theirs. A newcomer starts there,
        # so a stream of clients that come once each cannot keep one waiting client behind them.
        active = sum(self.weight(c) for c in self._queues)
        least = min(self._vtime[c] for c in self._queues)
        self._now = max(self._now + cost / active, least)
        if len(self._vtime) > 2 * len(self._queues) + 64:  # clients gone, their credit spent
            for client in [c for c, v in self._vtime.items() if c not in self._queues]:
                if self._vtime[client] <= self._now:
                    del self._vtime[client]

    def by_client(self) -> list[tuple[str, deque[W]]]:
        """Each waiting client with its waiters in arrival order (the order it lets them go)."""
        return list(self._queues.items())

    def share(self, client: str) -> float:
        """The share of departures ``client`` gets while it waits beside those waiting now."""
        active = set(self._queues) | {client}
        return self.weight(client) / sum(self.weight(c) for c in active)

    def position(self, client: str) -> int:
        """Where a newcomer of ``client`` stands, in departures (1: it goes next): its own
        queue's length over its share, at most behind every waiter."""
        own = len(self._queues.get(client, ())) + 1
        return min(len(self.all) + 1, max(1, round(own / self.share(client))))
