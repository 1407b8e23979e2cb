"""Overload queues, it does not fail: requests wait at the router, in arrival order, while every
decode node holds as many of this router's requests as it may take (``Node.capacity``: its
``max_num_seqs`` times the router's ``--decode-overcommit``), and go as soon as one ends.

A request fails only when the queue is full (``--max-queue``: RESOURCE_EXHAUSTED at once) or
its wait runs past ``--queue-timeout-s`` (RESOURCE_EXHAUSTED) or its deadline
(DEADLINE_EXCEEDED). Arrival order is kept: a newcomer queues behind waiting requests even when
a slot is free at that instant. Queue length and waits are in ``/metrics``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import grpc

from splitserve.router.errors import GenerateError
from splitserve.router.pool import NodePool
from splitserve.runtime.metrics import RouterMetrics

RECHECK_S = 0.5  # waiters look again this often even without news (a node joined, came back)


class Admission:
    def __init__(
        self,
        pool: NodePool,
        metrics: RouterMetrics,
        max_waiting: int = 4096,
        max_wait_s: float = 300.0,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        # One wake-up future per waiter, in arrival order; only the head is woken.
        self._waiters: deque[list[asyncio.Future]] = deque()
        pool.on_release = self.notify  # a request left a decode node: the head may go

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Wake the head of the queue (it looks whether a node has room now)."""
        if self._waiters:
            wake = self._waiters[0][0]
            if not wake.done():
                wake.set_result(None)

    async def enter(self, deadline: float) -> None:
        """Return once this request may be sent to a decode node (at once when nothing waits
        and a node has room, or when no node is usable: the caller then reports that);
        ``GenerateError`` when it may not wait any longer."""
        if (not self._waiters and self._pool.has_room()) or not self._pool.usable():
            return
        if len(self._waiters) >= self.max_waiting:
            raise GenerateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"every decode node is full and {len(self._waiters)} requests are already "
                "waiting (the router's --max-queue); retry later or add decode nodes",
            )
        loop = asyncio.get_running_loop()
        me = [loop.create_future()]
        self._waiters.append(me)
        self._metrics.queue_length.set(len(self._waiters))
        start = time.monotonic()
        give_up = min(deadline, start + self.max_wait_s)
        try:
            while not (
                self._waiters[0] is me and (self._pool.has_room() or not self._pool.usable())
            ):
                left = give_up - time.monotonic()
                if left <= 0:
                    raise self._timed_out(deadline, start)
                if me[0].done():
                    me[0] = loop.create_future()
                # The head also looks again now and then (a node joined or came back up).
                timeout = min(left, RECHECK_S) if self._waiters[0] is me else left
                await asyncio.wait([me[0]], timeout=timeout)
        finally:
            self._waiters.remove(me)
            self._metrics.queue_length.set(len(self._waiters))
            self._metrics.queue_wait.observe(time.monotonic() - start)
            self.notify()  # the next in line looks again

    def _timed_out(self, deadline: float, start: float) -> GenerateError:
        waited = time.monotonic() - start
        if time.monotonic() >= deadline:
            return GenerateError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request's deadline passed after {waited:.1f} s waiting for a decode slot",
            )
        return GenerateError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"waited {waited:.1f} s (the router's --queue-timeout-s) for a decode slot; every "
            "decode node stayed full: retry later or add decode nodes",
        )
