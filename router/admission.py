"""Overload queues at the router, in one bounded place; what cannot wait, or cannot meet its
latency targets, is refused at once.

A request is let go to the pools only when both can take it:

- a decode node has a sequence slot for it (``Node.capacity``: its ``max_num_seqs`` times the
  router's ``--decode-overcommit``), room in its KV ledger for its blocks (``router.kv_budget``),
  so the prefill node never computes KV that has nowhere to go, and, with a TPOT target, a batch
  one larger still predicted within it (``router.predictor``: the decode horizon);
- a prefill node has room for its prompt tokens (``Node.max_queued_tokens``), so the excess waits
  here, where a node that joins finds it, not in one node's queue.

Requests wait fairly between clients (``router.fair_queue``: each client's share by its weight,
arrival order within one; only the head is let go). A request is refused with
RESOURCE_EXHAUSTED, before any node did work for it, when the queue is full (``--max-queue``),
when its prompt is larger than any decode node's KV, when the queue's recent pace says its wait
would outlast its deadline or ``--queue-timeout-s``, or when it has waited that long; with a TTFT
target (``--slo`` or the request's own), when its predicted time to first token is past it
(``slo_ttft``, at arrival) or it waited until it could no longer meet it (``slo_expired``).
Waiters are judged again every ``JUDGE_S`` from where they stand (their place in the fair queue's
order at its recent pace, the prompt tokens ahead at the prefill rate): one that can no longer go
before its TTFT target, deadline or ``--queue-timeout-s`` is refused then, not when the limit
passes, and the predictor's margin learns from it. Its deadline passing in the queue is
DEADLINE_EXCEEDED. Each refusal carries a retry-after hint and
is counted by reason (``splitserve_router_refused_total{reason}``). A request that finds room
(nothing waiting) is still refused (``slo_ttft``) when the prefill nodes' backlog puts its first
token past its target, unless none was let go for ``PROBE_S``: the predictor learns only from
requests it lets go.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from splitserve.router.fair_queue import FairQueue
from splitserve.router.kv_budget import KVDemand
from splitserve.router.metrics import REFUSAL_REASONS, RouterMetrics
from splitserve.router.pool import DecodePool, NodePool
from splitserve.router.predictor import (
    MAX_CLIENT_MARGINS,
    PrefillLoad,
    RunningQuantile,
    TTFTPrediction,
    TTFTPredictor,
    quantile,
)
from splitserve.router.request import GenerateError
from splitserve.runtime.failure import Failure
from splitserve.runtime.slo import Slo

RECHECK_S = 0.5  # waiters look again this often even without news (a node joined, came back)
JUDGE_S = 0.1  # the waiters are judged again this often (see the module's docstring)
# A router with no decode node to try (started before its nodes registered, or all of them gone)
# holds a request this long at most (never past its deadline) for one to appear, looking again
# every NODE_POLL_S, before answering UNAVAILABLE: nodes register within seconds of starting.
NODE_WAIT_S = 10.0
NODE_POLL_S = 0.05
PACE_WINDOW = 64  # departures from the queue the wait estimate is drawn from
PACE_MIN = 16  # fewer departures than this: no estimate, requests wait up to their limits
PACE_STALE_S = 5.0  # no departure for this long: the pace is not known
WAITS_WINDOW_S = 60.0  # queue wait quantiles are over the requests that left in this window
SERVICE_QUANTILE = 0.9  # a queued request needs this quantile of them left before its deadline
# With room in the pools, a request predicted to miss its TTFT target is still let go when none
# was for this long: the predictor learns only from requests it lets go.
PROBE_S = 0.2
# The learned margin takes at most this share of a request's TTFT target: errors of a burst the
# predictor had not learned yet must not refuse everything for as long as they are remembered.
MAX_MARGIN_SHARE = 0.5
# With a TTFT target, the prefill nodes take work while what they hold is at most this share of
# the target (in seconds at their measured rate): the rest waits in the router's fair queue,
# where a light client's request goes ahead of a heavy client's burst (the nodes serve in order,
# so what they hold is every client's wait).
BACKLOG_SHARE = 0.1
# Admission's headroom, per client: a request that must queue is let in only when its predicted
# TTFT is within this share of its target (the rest is slack for the queue running slower than
# predicted). Each of the client's queued requests refused late (its target or limit passed, or
# it was judged out of reach, while it waited) takes HEADROOM_DOWN of it off, to HEADROOM_MIN at
# most; each let go in time gives HEADROOM_UP back, to 1, and time gives it back too (all of it
# over HEADROOM_RECOVER_S without a late refusal: what a burst taught is forgotten, as the
# predictor forgets). In balance about one late refusal per HEADROOM_DOWN / HEADROOM_UP (~150)
# requests let go: the rest are refused at arrival, at once.
# Per client: a heavy client's long queue runs late, a light client's short one does not (the
# fair queue lets it go first), and one headroom for both would refuse the light one's requests.
HEADROOM_MIN = 0.4
HEADROOM_DOWN = 0.15  # multiplicative
HEADROOM_UP = 0.001  # additive
HEADROOM_RECOVER_S = 60.0


@dataclass(slots=True, eq=False)
class Waiter:
    wake: asyncio.Future
    demand: KVDemand | None
    cost: int  # prompt tokens to compute (its share of the pools: router.fair_queue)
    since: float = field(default_factory=time.monotonic)
    tpot_s: float | None = None  # its TPOT target: decode room is a batch that still meets it
    client: str = ""  # who sent it (router.fair_queue)
    ttft_s: float | None = None  # its TTFT target: prefill room is a backlog well within it
    give_up: float = math.inf  # the latest it may still be let go (its limit)
    ttft_by: float | None = None  # that limit when it is its TTFT target's
    prediction: TTFTPrediction | None = None  # what was predicted for it at arrival
    refusal: GenerateError | None = None  # set when it was judged unable to go in time

    def wake_up(self) -> None:
        if not self.wake.done():
            self.wake.set_result(None)


class Admitted(NamedTuple):
    """A request let go to the pools: when, and what admission predicted for it then."""

    at: float  # time.monotonic()
    prediction: TTFTPrediction | None  # None: no prediction was made (no decode node usable)
    load: PrefillLoad  # the prefill pool's when it was let go
    own_tokens: int  # its uncached prompt tokens
    client: str = ""  # who sent it (its own margin: router.predictor)


class Admission:
    def __init__(
        self,
        decode: DecodePool,
        metrics: RouterMetrics,
        max_waiting: int = 4096,
        max_wait_s: float = 300.0,
        prefill: NodePool | None = None,
        rates: NodePool | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self._decode = decode
        self._prefill = prefill  # None: prefill room is not waited for
        self._rates = rates if rates is not None else prefill  # the prefill pool's busy rates
        self.predictor = TTFTPredictor()
        self._admitted = 0.0  # when a request was last let go
        self._metrics = metrics
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        # Fair between clients, in arrival order within one; only the head is woken.
        self._queue: FairQueue[Waiter] = FairQueue(weights)
        self._departures: deque[float] = deque(maxlen=PACE_WINDOW)  # when waiters were let go
        self._waits: deque[tuple[float, float]] = deque()  # (when it left, how long it waited)
        # How long requests took once let go, recently: one that could no longer finish before
        # its deadline is refused rather than let go to fail there (its prefill thrown away).
        self._service = RunningQuantile(SERVICE_QUANTILE)
        self._decoding = RunningQuantile(SERVICE_QUANTILE)  # from the first token to the end
        self._judge: asyncio.Task | None = None  # re-judges the waiters while any wait
        # Each client's share of a TTFT target its queued requests are admitted to (absent: 1),
        # the least recently changed first.
        self._headroom: OrderedDict[str, tuple[float, float]] = OrderedDict()  # (share, when)
        metrics.admission_headroom.set_function(self.lowest_headroom)
        decode.on_release = self.notify  # a request left a decode node: the head may go
        if prefill is not None:
            prefill.on_release = self.notify

    def __len__(self) -> int:
        return len(self._queue)

    # NOTE: the three figures below are read on the metrics server's thread while the event
    # loop changes the deques: they read C-level snapshots (tuple() of a deque is atomic under
    # the GIL) and change nothing.

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(w.cost for w in tuple(self._queue.all))

    def oldest_wait_s(self) -> float:
        waiters = tuple(self._queue.all)
        return time.monotonic() - waiters[0].since if waiters else 0.0

    def wait_quantiles(self, qs: tuple[float, ...]) -> list[float]:
        """Quantiles of the queue waits of the requests that left in the last WAITS_WINDOW_S
        (0 when none did)."""
        since = time.monotonic() - WAITS_WINDOW_S
        waits = sorted(w for left, w in tuple(self._waits) if left >= since)
        return [quantile(waits, q) for q in qs] if waits else [0.0] * len(qs)

    def note_served(self, service_s: float) -> None:
        """A request ended served ``service_s`` after ``enter`` let it go."""
        self._service.add(service_s)

    def note_decoded(self, decode_s: float) -> None:
        """A request ended served ``decode_s`` after its first token."""
        self._decoding.add(decode_s)

    @property
    def service_s(self) -> float:
        """How long serving a request takes once let go: the SERVICE_QUANTILE of the recent
        ones (0 until 16 were served)."""
        return self._service.value

    def first_token(self, admitted: Admitted, arrival: float) -> None:
        """A request ``enter`` let go reached its first token now: the predictor learns."""
        if admitted.prediction is None:
            return
        error = self.predictor.observe(
            admitted.prediction,
            admitted.at - arrival,
            time.monotonic() - arrival,
            admitted.own_tokens,
            admitted.load,
            admitted.client,
        )
        self._metrics.ttft_prediction_error.observe(error)

    def notify(self) -> None:
        """Wake the head of the queue (it looks whether the pools have room now)."""
        head = self._queue.head()
        if head is not None:
            head.wake_up()

    def _room(
        self, demand: KVDemand | None, work: int, tpot_s: float | None, ttft_s: float | None
    ) -> bool:
        if not self._decode.has_room(demand, tpot_s=tpot_s):
            return False
        prefill = self._prefill
        if prefill is None or not prefill.usable():
            return True
        if ttft_s is not None and self.load().seconds(0) > BACKLOG_SHARE * ttft_s:
            return False  # the excess waits here, in the fair queue, not in the nodes' FIFO
        return prefill.has_room(work=work)

    def load(self) -> PrefillLoad:
        """The prefill pool now: its measured rate and the prompt tokens it has to compute."""
        pool = self._rates
        if pool is None:
            return PrefillLoad(None, 0)
        return PrefillLoad(pool.prefill_capacity(), sum(n.queued_tokens for n in pool.usable()))

    def predict(
        self, own_tokens: int, client: str = "", ttft_s: float | None = None, queued: bool = True
    ) -> TTFTPrediction:
        """The TTFT of a request of ``client`` that queues now (``queued`` False: one that goes
        now): its fair position's share of the queue's pace and of the prompt tokens queued;
        with its target ``ttft_s``, the margin (the client's) at most MAX_MARGIN_SHARE of it."""
        position = ahead = 0
        if queued:
            position = self._queue.position(client)
            share = min(1.0, (position - 1) / max(len(self._queue), 1))
            ahead = int(self.queued_prompt_tokens * share)
        load = self.load()
        prediction = self.predictor.predict(position, self._pace(), ahead, own_tokens, load, client)
        if ttft_s is not None and prediction.margin_s > MAX_MARGIN_SHARE * ttft_s:
            prediction = prediction._replace(margin_s=MAX_MARGIN_SHARE * ttft_s)
        return prediction

    async def enter(
        self,
        deadline: float,
        demand: KVDemand | None = None,
        work: int = 0,
        slo: Slo | None = None,
        arrival: float | None = None,
        client: str = "",
    ) -> Admitted:
        """Return once this request may be sent to the pools: at once when nothing waits and they
        have room, or when no decode node is usable (the caller then reports that);
        ``GenerateError`` when it may not wait (any longer). ``work``: its uncached prompt
        tokens; ``slo``: its targets (a TTFT target it is predicted to miss, or that passes while
        it waits, refuses it: ``slo_ttft``, ``slo_expired``); ``arrival``: when it reached the
        router (default: now); ``client``: who sent it (the queue is fair between clients)."""
        start = time.monotonic()
        arrival = start if arrival is None else arrival
        ttft_s, tpot_s = slo or Slo()  # Slo(): no targets (None, None)
        decode_s = self._decoding.value  # first token to end, recently (0: not 16 served yet)
        if ttft_s is not None and decode_s:
            # Its first token must leave it the time decoding takes before its deadline.
            ttft_s = min(ttft_s, deadline - arrival - decode_s)
        if not self._decode.has_candidates():
            await self._wait_for_a_node(deadline, start)
            start = time.monotonic()  # (what follows judges from now: the wait counts)
        if not self._decode.usable():
            return Admitted(start, None, PrefillLoad(None, 0), work, client)
        self._check_fits(demand)
        if not self._queue and self._room(demand, work, tpot_s, ttft_s):
            prediction = self.predict(work, client, ttft_s, queued=False)
            if ttft_s is not None and start - self._admitted < PROBE_S:
                # Room by count, but the nodes' backlog may already be past the target.
                self._check_slo(prediction, start, arrival, ttft_s)
            # NOTE: counted in the pace too: when a queue first forms, its pace is then known at
            # once (at most the arrival rate so far, which the pools kept up with: a wait
            # predicted from it is too long, never too short, until queued departures replace it).
            self._departures.append(start)
            self._admitted = start
            return Admitted(start, prediction, self.load(), work, client)
        prediction = self.predict(work, client, ttft_s)
        latest, give_up = self._check_wait(deadline, start, client)
        ttft_by = None  # the latest it may be let go and still meet its TTFT target
        if ttft_s is not None:
            self._check_slo(prediction, start, arrival, ttft_s, self.headroom(client))
            # NOTE: the margin buys the wait room to run late at arrival; once queued, a request
            # goes as long as its own part can still end within the target.
            ttft_by = arrival + ttft_s - prediction.own_s
            give_up = min(give_up, ttft_by)
        loop = asyncio.get_running_loop()
        me = Waiter(loop.create_future(), demand, work, start, tpot_s, client, ttft_s)
        me.give_up, me.ttft_by, me.prediction = give_up, ttft_by, prediction
        self._queue.append(me)
        if self._judge is None or self._judge.done():
            self._judge = loop.create_task(self._judge_while_waiting())
        self._metrics.queue_length.set(len(self._queue))
        decode = self._decode
        decode.waiting += 1
        if decode.waiting == 1:
            decode.load_changed()  # its nodes' leases: it wants all it may fill now
        let_go = False
        try:
            while me.refusal is not None or not (self._queue.head() is me and self._can_go(me)):
                if me.refusal is not None:
                    raise me.refusal
                left = give_up - time.monotonic()
                if left <= 0:
                    self._refused_late(client)
                    if ttft_by is not None and time.monotonic() >= ttft_by:
                        self.predictor.expired(prediction, time.monotonic() - start, client)
                        raise self._slo_expired(
                            f"waited {time.monotonic() - start:.2f} s for room in the pools",
                            prediction.own_s,
                            ttft_s,
                            self._pace_wait(len(self._queue)),
                        )
                    raise self._timed_out(deadline, latest, start)
                if me.wake.done():
                    me.wake = loop.create_future()
                # The head also looks again now and then (a node joined or came back up).
                timeout = min(left, RECHECK_S) if self._queue.head() is me else left
                await asyncio.wait([me.wake], timeout=timeout)
            let_go = True
            self._queue.let_go(me)
            self._admitted = time.monotonic()
            if ttft_by is not None:
                self._let_go_in_time(client)
            return Admitted(self._admitted, prediction, self.load(), work, client)
        finally:
            self._queue.remove(me)
            decode.waiting -= 1
            if not decode.waiting:
                decode.load_changed()
            now = time.monotonic()
            self._metrics.queue_length.set(len(self._queue))
            self._metrics.queue_wait.observe(now - start)
            self._waits.append((now, now - start))
            while self._waits[0][0] < now - WAITS_WINDOW_S:
                self._waits.popleft()
            if let_go:
                self._departures.append(now)
            self.notify()  # the next in line looks again

    async def _judge_while_waiting(self) -> None:
        while self._queue:
            await asyncio.sleep(JUDGE_S)
            self._judge_waiters(time.monotonic())

    def _judge_waiters(self, now: float) -> None:
        """Refuse, now, each waiter whose wait from where it stands (its place in the fair
        queue's order at the recent pace, and the prompt tokens ahead of it at the prefill
        pool's rate, as at arrival) ends past its limit; the predictor learns its wait as
        one that ran that much longer than predicted (its margin grows, so fewer are let in
        that will not make it)."""
        pace = self._pace()
        capacity = self.load().capacity
        queue = self._queue
        waiting = len(queue)
        if not waiting or (not pace and not capacity):
            return
        tokens = self.queued_prompt_tokens
        for client, waiters in queue.by_client():
            share = queue.share(client)
            for k, w in enumerate(waiters):
                if w.refusal is not None or w.give_up == math.inf:
                    continue
                position = min(waiting, max(1, round((k + 1) / share)))
                wait = position / pace if pace else 0.0
                if capacity:
                    wait = max(wait, tokens * (position - 1) / waiting / capacity)
                if now + wait <= w.give_up:
                    continue
                w.refusal = self._cannot_go_in_time(w, now, wait, position, pace)
                self._refused_late(w.client)
                if w.prediction is not None and w.ttft_by is not None:
                    self.predictor.expired(w.prediction, now - w.since + wait, w.client)
                w.wake_up()

    def _cannot_go_in_time(
        self, w: Waiter, now: float, wait: float, position: int, pace: float
    ) -> GenerateError:
        where = (
            f"waited {now - w.since:.2f} s; {position - 1} requests go before it"
            + (f" at ~{pace:.1f}/s" if pace else "")
            + f" (~{wait:.2f} s more)"
        )
        if w.ttft_by is not None and w.give_up >= w.ttft_by:
            own = w.prediction.own_s if w.prediction is not None else 0.0
            return self._slo_expired(where, own, w.ttft_s, wait)
        return self._refuse(
            "queue_wait",
            f"{where}: it could no longer be let go in time to be served before its deadline "
            "or the router's --queue-timeout-s; retry later or add nodes",
            wait,
        )

    async def _wait_for_a_node(self, deadline: float, start: float) -> None:
        """No decode node to try: hold the request until one registers, at most NODE_WAIT_S and
        never past its deadline (then the caller answers UNAVAILABLE, naming the pool)."""
        until = min(deadline, start + NODE_WAIT_S)
        while not self._decode.has_candidates() and (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(NODE_POLL_S, left))

    def check_arrival(
        self,
        deadline: float,
        slo: Slo | None = None,
        client: str = "",
        arrival: float | None = None,
    ) -> None:
        """Refuse (``GenerateError``) a request that would have to queue and may not: the queue
        is full, its pace puts the wait past the deadline or ``--queue-timeout-s`` (less the
        time serving it takes), or the predicted TTFT of a request at the end of the queue
        (before its own prompt is known) is past ``slo``'s target. Needs no prompt: the front
        calls it before parsing one, so under overload a refused request costs the router next
        to nothing; ``enter`` checks again. ``arrival``: when the call reached the host (before
        the handler ran, ``front.LoopLag``; default now): its TTFT target counts from there."""
        if not self._queue:  # nothing waits: whether there is room is enter's to say
            return
        now = time.monotonic()
        self._check_wait(deadline, now, client)
        if slo is not None and slo.ttft_s is not None:
            share = self.headroom(client)
            arrival = now if arrival is None else arrival
            self._check_slo(self.predict(0, client, slo.ttft_s), now, arrival, slo.ttft_s, share)

    def _check_slo(
        self,
        prediction: TTFTPrediction,
        now: float,
        arrival: float,
        ttft_s: float,
        share: float = 1.0,
    ) -> None:
        """Refuse a request whose predicted time to first token ends past ``share`` of its TTFT
        target ``ttft_s`` after its ``arrival`` (when it would queue: its client's headroom)."""
        target = arrival + share * ttft_s
        if now + prediction.ttft_s <= target:
            return
        # Retry once the queue has drained enough for a newcomer to meet the same target.
        budget = target - now - prediction.own_s - prediction.margin_s
        within = "its TTFT target"
        if share < 1.0:
            within = (
                f"{share:.2f} of its TTFT target of {ttft_s:g} s (this client's queued requests "
                "ran out of time lately, so the router admits them to less of it)"
            )
        raise self._refuse(
            "slo_ttft",
            f"predicted time to first token {prediction.ttft_s:.2f} s (queue wait "
            f"{prediction.wait_s:.2f} s behind {len(self._queue)} requests, then "
            f"{prediction.own_s:.2f} s "
            f"+ {prediction.margin_s:.2f} s margin) is past {within} "
            f"({target - now:.2f} s left): retry later, with a larger target, or add nodes",
            max(prediction.wait_s - max(budget, 0.0), 0.0),
        )

    def headroom(self, client: str) -> float:
        """The share of a TTFT target ``client``'s requests that must queue are admitted to."""
        held = self._headroom.get(client)
        return 1.0 if held is None else _recovered(held, time.monotonic())

    def lowest_headroom(self) -> float:
        """The lowest of any client's headroom (1: none held back). Read on the metrics
        server's thread: it works on a C-level copy of the values, as the figures above do."""
        now = time.monotonic()
        return min((_recovered(h, now) for h in tuple(self._headroom.values())), default=1.0)

    def _set_headroom(self, client: str, share: float) -> None:
        headroom = self._headroom
        headroom.pop(client, None)
        if share < 1.0:
            headroom[client] = (share, time.monotonic())  # the most recently changed last
            if len(headroom) > MAX_CLIENT_MARGINS:
                headroom.popitem(last=False)

    def _refused_late(self, client: str) -> None:
        """A queued request of ``client`` was refused after waiting: admit to less."""
        self._set_headroom(client, max(HEADROOM_MIN, self.headroom(client) * (1 - HEADROOM_DOWN)))

    def _let_go_in_time(self, client: str) -> None:
        """A queued request of ``client`` with a TTFT target was let go in time: admit to more."""
        if client in self._headroom:
            self._set_headroom(client, min(1.0, self.headroom(client) + HEADROOM_UP))

    def _slo_expired(
        self, where: str, own_s: float, ttft_s: float | None, retry_after_s: float | None
    ) -> GenerateError:
        """A queued request whose TTFT target could no longer be met (``where``: how long it
        waited, and where it stands): refused before any node worked on it."""
        return self._refuse(
            "slo_expired",
            f"{where}; with ~{own_s:.2f} s more to its first token it can no longer meet its "
            f"TTFT target of {ttft_s} s: retry later, with a larger target, or add nodes",
            retry_after_s,
        )

    def _check_wait(self, deadline: float, start: float, client: str) -> tuple[float, float]:
        """Refuse a request that may not queue (see ``check_arrival``); else its limits: the
        latest time it may still be let go (past it, it could not be served before its deadline)
        and the time it gives up (that, or ``--queue-timeout-s``)."""
        waiting = len(self._queue)
        if waiting >= self.max_waiting:
            raise self._refuse(
                "queue_full",
                f"the pools are full and {waiting} requests are already waiting (the "
                "router's --max-queue); retry later or add nodes",
                self._pace_wait(waiting),
            )
        latest = deadline - self.service_s
        give_up = min(latest, start + self.max_wait_s)
        estimate = self._pace_wait(self._queue.position(client))
        if estimate is not None and start + estimate > give_up:
            limit = "deadline" if latest < start + self.max_wait_s else "--queue-timeout-s"
            raise self._refuse(
                "queue_wait",
                f"{waiting} requests are waiting ahead of this one and the router lets "
                f"about {self._pace():.1f}/s go: its wait (~{estimate:.1f} s) would outlast its "
                f"{limit} (less ~{self.service_s:.1f} s to serve it: {give_up - start:.1f} s "
                "left); retry later or add nodes",
                estimate,
            )
        return latest, give_up

    def _can_go(self, me: Waiter) -> bool:
        if not self._decode.usable():
            return True  # the caller reports that no node is usable
        return self._room(me.demand, me.cost, me.tpot_s, me.ttft_s)

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

    def _refuse(self, reason: str, message: str, retry_after_s: float | None) -> GenerateError:
        assert reason in REFUSAL_REASONS, reason
        self._metrics.refused.labels(reason=reason).inc()
        hint = retry_after_hint(retry_after_s)
        return GenerateError(Failure.REFUSED, message, retry_after_s=hint, reason=reason)

    def _timed_out(self, deadline: float, latest: float, start: float) -> GenerateError:
        now = time.monotonic()
        waited = now - start
        if now >= deadline:
            self._metrics.refused.labels(reason="deadline").inc()
            return GenerateError(
                Failure.DEADLINE,
                f"the request's deadline passed after {waited:.1f} s waiting for room in the pools",
            )
        if now >= latest:
            return self._refuse(
                "queue_wait",
                f"waited {waited:.1f} s for room in the pools; serving it takes ~"
                f"{self.service_s:.1f} s, more than is left before its deadline: retry later or "
                "add nodes",
                self._pace_wait(len(self._queue)),
            )
        return self._refuse(
            "queue_timeout",
            f"waited {waited:.1f} s (the router's --queue-timeout-s) for room in the pools; they "
            "stayed full: retry later or add nodes",
            self._pace_wait(len(self._queue)),
        )


def _recovered(held: tuple[float, float], now: float) -> float:
    """A headroom ``(share, when it was set)`` as time has given it back by ``now``."""
    share, since = held
    return min(1.0, share + (now - since) / HEADROOM_RECOVER_S)


def retry_after_hint(seconds: float | None) -> int:
    """Whole seconds for a Retry-After header: the estimate rounded up, 1 at least."""
    if seconds is None or not math.isfinite(seconds):
        return 1
    return max(1, min(math.ceil(seconds), 3600))
