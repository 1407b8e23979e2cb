"""Overload queues at the router, in one bounded place, and what cannot wait is refused at once.

A request is let go to the pools only when both can take it:

- a decode node has a sequence slot for it (``Node.capacity``: its ``max_num_seqs`` times the
  router's ``--decode-overcommit``) and room in its KV ledger for its blocks
  (``router.kv_budget``), so the prefill node never computes KV that has nowhere to go;
- a prefill node has room for its prompt tokens (``Node.max_queued_tokens``), so the excess waits
  here, where a node that joins finds it, not in one node's queue.

Requests wait in arrival order (a newcomer queues behind waiting requests even when there is room
at that instant; only the head is let go). A request is refused with RESOURCE_EXHAUSTED, before
any node did work for it, when the queue is full (``--max-queue``), when its prompt is larger than
any decode node's KV, when the queue's recent pace says its wait would outlast its deadline or
``--queue-timeout-s``, or when it has waited that long; its deadline passing in the queue is
DEADLINE_EXCEEDED. Each refusal carries a retry-after hint and is counted by reason
(``splitserve_router_refused_total{reason}``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from splitserve.router.errors import GenerateError
from splitserve.router.kv_budget import KVDemand
from splitserve.router.pool import NodePool
from splitserve.runtime.metrics import REFUSAL_REASONS, RouterMetrics

RECHECK_S = 0.5  # waiters look again this often even without news (a node joined, came back)
PACE_WINDOW = 64  # departures from the queue the wait estimate is drawn from
PACE_MIN = 16  # fewer departures than this: no estimate, requests wait up to their limits
PACE_STALE_S = 5.0  # no departure for this long: the pace is not known
WAITS_WINDOW_S = 60.0  # queue wait quantiles are over the requests that left in this window
SERVICE_WINDOW = 256  # recent requests' service times (from leaving the queue to the end)
SERVICE_QUANTILE = 0.9  # a queued request needs this quantile of them left before its deadline
SERVICE_MIN = 16  # fewer served than this: no service estimate (0)


@dataclass(slots=True, eq=False)
class Waiter:
    wake: asyncio.Future
    demand: KVDemand | None
    work: int  # prompt tokens to compute
    since: float = field(default_factory=time.monotonic)


class Admission:
    def __init__(
        self,
        decode: NodePool,
        metrics: RouterMetrics,
        max_waiting: int = 4096,
        max_wait_s: float = 300.0,
        prefill: NodePool | None = None,
    ) -> None:
        self._decode = decode
        self._prefill = prefill  # None: prefill room is not waited for
        self._metrics = metrics
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        # In arrival order; only the head is woken.
        self._waiters: deque[Waiter] = deque()
        self._departures: deque[float] = deque(maxlen=PACE_WINDOW)  # when waiters were let go
        self._waits: deque[tuple[float, float]] = deque()  # (when it left, how long it waited)
        # How long requests took once let go, recently: one that could no longer finish before
        # its deadline is refused rather than let go to fail there (its prefill thrown away).
        self._service: deque[float] = deque(maxlen=SERVICE_WINDOW)
        self._service_s = 0.0
        decode.on_release = self.notify  # a request left a decode node: the head may go
        if prefill is not None:
            prefill.on_release = self.notify

    def __len__(self) -> int:
        return len(self._waiters)

    # NOTE: the three figures below are read on the metrics server's thread while the event
    # loop changes the deques: they read C-level snapshots (tuple() of a deque is atomic under
    # the GIL) and change nothing.

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(w.work for w in tuple(self._waiters))

    def oldest_wait_s(self) -> float:
        waiters = tuple(self._waiters)
        return time.monotonic() - waiters[0].since if waiters else 0.0

    def wait_quantiles(self, qs: tuple[float, ...]) -> list[float]:
        """Quantiles of the queue waits of the requests that left in the last WAITS_WINDOW_S
        (0 when none did)."""
        since = time.monotonic() - WAITS_WINDOW_S
        waits = sorted(w for left, w in tuple(self._waits) if left >= since)
        if not waits:
            return [0.0 for _ in qs]
        return [waits[min(int(q * len(waits)), len(waits) - 1)] for q in qs]

    def note_served(self, service_s: float) -> None:
        """A request ended served ``service_s`` after ``enter`` let it go."""
        self._service.append(service_s)
        if len(self._service) >= SERVICE_MIN and len(self._service) % 8 == 0:
            ordered = sorted(self._service)
            self._service_s = ordered[int(SERVICE_QUANTILE * (len(ordered) - 1))]

    @property
    def service_s(self) -> float:
        """How long serving a request takes once let go: the SERVICE_QUANTILE of the recent
        ones (0 until SERVICE_MIN were served)."""
        return self._service_s

    def notify(self) -> None:
        """Wake the head of the queue (it looks whether the pools have room now)."""
        if self._waiters:
            wake = self._waiters[0].wake
            if not wake.done():
                wake.set_result(None)

    def _room(self, demand: KVDemand | None, work: int) -> bool:
        if not self._decode.has_room(demand):
            return False
        prefill = self._prefill
        return prefill is None or not prefill.usable() or prefill.has_room(work=work)

    async def enter(self, deadline: float, demand: KVDemand | None = None, work: int = 0) -> float:
        """Return (the time, ``time.monotonic()``) once this request may be sent to the pools:
        at once when nothing waits and they have room, or when no decode node is usable (the
        caller then reports that); ``GenerateError`` when it may not wait (any longer)."""
        if not self._decode.usable():
            return time.monotonic()
        self._check_fits(demand)
        if not self._waiters and self._room(demand, work):
            return time.monotonic()
        start = time.monotonic()
        latest, give_up = self._check_wait(deadline, start)
        loop = asyncio.get_running_loop()
        me = Waiter(loop.create_future(), demand, work, start)
        self._waiters.append(me)
        self._metrics.queue_length.set(len(self._waiters))
        let_go = False
        try:
            while not (self._waiters[0] is me and self._can_go(me)):
                left = give_up - time.monotonic()
                if left <= 0:
                    raise self._timed_out(deadline, latest, start)
                if me.wake.done():
                    me.wake = loop.create_future()
                # The head also looks again now and then (a node joined or came back up).
                timeout = min(left, RECHECK_S) if self._waiters[0] is me else left
                await asyncio.wait([me.wake], timeout=timeout)
            let_go = True
            return time.monotonic()
        finally:
            self._waiters.remove(me)
            now = time.monotonic()
            self._metrics.queue_length.set(len(self._waiters))
            self._metrics.queue_wait.observe(now - start)
            self._waits.append((now, now - start))
            self._trim_waits(now)
            if let_go:
                self._departures.append(now)
            self.notify()  # the next in line looks again

    def check_arrival(self, deadline: float) -> None:
        """Refuse (``GenerateError``) a request that would have to queue and may not: the queue
        is full, or its pace puts the wait past the deadline or ``--queue-timeout-s`` (less the
        time serving it takes). Needs no prompt: the front calls it before parsing one, so under
        overload a refused request costs the router next to nothing; ``enter`` checks again."""
        if self._waiters:  # nothing waits: whether there is room is enter's to say
            self._check_wait(deadline, time.monotonic())

    def _check_wait(self, deadline: float, start: float) -> tuple[float, float]:
        """Refuse a request that may not queue (see ``check_arrival``); else its limits: the
        latest time it may still be let go (past it, it could not be served before its deadline)
        and the time it gives up (that, or ``--queue-timeout-s``)."""
        if len(self._waiters) >= self.max_waiting:
            raise self._refuse(
                "queue_full",
                f"the pools are full and {len(self._waiters)} requests are already waiting (the "
                "router's --max-queue); retry later or add nodes",
                self._pace_wait(len(self._waiters)),
            )
        latest = deadline - self.service_s
        give_up = min(latest, start + self.max_wait_s)
        estimate = self._pace_wait(len(self._waiters) + 1)
        if estimate is not None and start + estimate > give_up:
            limit = "deadline" if latest < start + self.max_wait_s else "--queue-timeout-s"
            raise self._refuse(
                "queue_wait",
                f"{len(self._waiters)} requests are waiting ahead of this one and the router lets "
                f"about {self._pace():.1f}/s go: its wait (~{estimate:.1f} s) would outlast its "
                f"{limit} (less ~{self.service_s:.1f} s to serve it: {give_up - start:.1f} s "
                "left); retry later or add nodes",
                estimate,
            )
        return latest, give_up

    def _can_go(self, me: Waiter) -> bool:
        if not self._decode.usable():
            return True  # the caller reports that no node is usable
        return self._room(me.demand, me.work)

    def _check_fits(self, demand: KVDemand | None) -> None:
        """Refuse a prompt no usable decode node could ever hold (its KV would have nowhere to
        go however long it waited)."""
        if demand is None:
            return
        nodes = self._decode.usable()
        if any(n.kv.can_ever_fit(demand) for n in nodes):
            return
        largest = max(n.kv.num_blocks or 0 for n in nodes)
        raise self._refuse(
            "prompt_too_large",
            f"the prompt needs {demand.prompt_blocks} KV blocks of {demand.block_size} tokens; "
            f"the largest decode node holds {largest}: shorten it or add a larger decode node",
            None,
        )

    def _pace(self) -> float:
        """Requests let go from the queue per second, recently (0: not known)."""
        d = self._departures
        if len(d) < PACE_MIN or time.monotonic() - d[-1] > PACE_STALE_S or d[-1] <= d[0]:
            return 0.0
        return (len(d) - 1) / (d[-1] - d[0])

    def _pace_wait(self, position: int) -> float | None:
        """How long the ``position``-th in line will wait at the recent pace (None: unknown)."""
        pace = self._pace()
        return position / pace if pace > 0 else None

    def _trim_waits(self, now: float) -> None:
        while self._waits and self._waits[0][0] < now - WAITS_WINDOW_S:
            self._waits.popleft()

    def _refuse(self, reason: str, message: str, retry_after_s: float | None) -> GenerateError:
        assert reason in REFUSAL_REASONS, reason
        self._metrics.refused.labels(reason=reason).inc()
        hint = retry_after_hint(retry_after_s)
        return GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s=hint)

    def _timed_out(self, deadline: float, latest: float, start: float) -> GenerateError:
        now = time.monotonic()
        waited = now - start
        if now >= deadline:
            self._metrics.refused.labels(reason="deadline").inc()
            return GenerateError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request's deadline passed after {waited:.1f} s waiting for room in the pools",
            )
        if now >= latest:
            return self._refuse(
                "queue_wait",
                f"waited {waited:.1f} s for room in the pools; serving it takes ~"
                f"{self.service_s:.1f} s, more than is left before its deadline: retry later or "
                "add nodes",
                self._pace_wait(len(self._waiters)),
            )
        return self._refuse(
            "queue_timeout",
            f"waited {waited:.1f} s (the router's --queue-timeout-s) for room in the pools; they "
            "stayed full: retry later or add nodes",
            self._pace_wait(len(self._waiters)),
        )


def retry_after_hint(seconds: float | None) -> int:
    """Whole seconds for a Retry-After header: the estimate rounded up, 1 at least."""
    if seconds is None or not math.isfinite(seconds):
        return 1
    return max(1, min(math.ceil(seconds), 3600))
