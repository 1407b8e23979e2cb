"""The load: requests sent at their arrival times and/or at a fixed concurrency.

``--request-rate`` alone: each request is sent at its arrival time (open loop). With
``--max-concurrency`` too, a request that arrives while every slot is busy waits in this client
(the ``queued`` figure) and is sent when one frees. ``--max-concurrency`` alone: a closed loop,
a new request as soon as one ends. Neither: every request at once. The run ends after
``--num-requests`` requests, or once ``--duration`` seconds have passed (no request is sent
after that; those in flight are awaited), whichever comes first. ``--warmup`` requests go first
and are not counted.

While the load runs, Python's cyclic garbage collector only looks at young objects, about once
a second (``young_collections_only``): a full collection stops the event loop for as long as it
takes to walk every object the process holds (100+ ms once the run has made many), and every
send due meanwhile leaves late; on the development machine that alone made sends' p99 lateness
3-4x what it was with the collector off (docs/benchmarks.md, "The load generator's own
lateness: stand_in_router.py").
A young collection still stops the loop for some milliseconds, so the open loop runs it in a
gap of its schedule (``YoungCollector.in_gap``: the next send at least twice the last
collection's time away), where it delays no send.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from splitserve.bench.arrivals import arrival_times
from splitserve.bench.metrics import RequestRecord
from splitserve.bench.workloads import BenchRequest

__all__ = ["Load", "Share", "run_load", "run_users", "young_collections_only"]

YOUNG_GC_EVERY_S = 1.0
# With no gap long enough in the schedule (a closed loop has none), a young collection runs
# anyway once this many YOUNG_GC_EVERY_S have passed: what it frees must not pile up.
YOUNG_GC_OVERDUE = 3.0


class YoungCollector:
    """Collects the two young generations about every ``every_s``: by ``in_gap``, where the
    caller's schedule leaves room, or by its own task where nothing calls that."""

    def __init__(self, every_s: float = YOUNG_GC_EVERY_S) -> None:
        self.every_s = every_s
        self.last = time.perf_counter()
        self.took_s = 0.005  # how long the last collection took (a guess before the first)
        self.collections = 0
        self.in_gaps = 0  # of them, in a gap of the caller's schedule

    def collect(self) -> None:
        start = time.perf_counter()
        gc.collect(1)
        self.last = time.perf_counter()
        self.took_s = self.last - start
        self.collections += 1

    def due(self) -> bool:
        return time.perf_counter() - self.last >= self.every_s

    def in_gap(self, gap_s: float) -> None:
        """The caller has nothing to do for ``gap_s`` seconds: collect now if one is due and it
        will be over well before then (or once it is overdue, whatever the gap)."""
        since = time.perf_counter() - self.last
        if since < self.every_s:
            return
        if gap_s >= 2 * self.took_s:
            self.in_gaps += 1
        elif since < YOUNG_GC_OVERDUE * self.every_s:
            return
        self.collect()


@contextlib.asynccontextmanager
async def young_collections_only(
    every_s: float = YOUNG_GC_EVERY_S, timer: bool = True
) -> AsyncIterator[YoungCollector]:
    """For the measured run: what lives now (imports, the workload's buffers) is frozen out of
    the collector's sight, automatic collection is off, and the two young generations are
    collected about every ``every_s`` (what was made since, less what refcounting freed:
    cheap): by a task of its own (``timer``), or by the caller through the ``YoungCollector``
    it yields (``in_gap``, where its schedule leaves room). Cycles that outlive that (rare: a
    finished request's are garbage at once) wait for the end, where everything is as it was
    before."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    collector = YoungCollector(every_s)

    async def collect() -> None:
        while True:
            await asyncio.sleep(every_s / 4)
            if timer:
                if collector.due():
                    collector.collect()
            else:  # the caller collects in its gaps; this only catches a caller that stalls
                collector.in_gap(0.0)

    task = asyncio.create_task(collect())
    try:
        yield collector
    finally:
        task.cancel()
        gc.unfreeze()
        if was_enabled:
            gc.enable()


@dataclass(frozen=True, slots=True)
class Load:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration: float | None = None
    warmup: int = 0
    seed: int = 0

    def check(self, paced_by_users: bool = False) -> None:
        """``paced_by_users``: conversation users pace the load (``run_users``), not a rate."""
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("--duration must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.warmup < 0:
            raise ValueError("--warmup must be 0 or more")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("--request-rate and --burstiness must be positive")
        if self.num_requests is None and self.duration is None:
            raise ValueError("give --num-requests or --duration")
        if (
            self.num_requests is None
            and math.isinf(self.request_rate)
            and self.max_concurrency is None
            and not paced_by_users
        ):
            raise ValueError("--duration needs --request-rate or --max-concurrency to pace it")


async def _warmup(target, requests: Iterator[BenchRequest], load: Load) -> None:
    slots = asyncio.Semaphore(load.max_concurrency or max(load.warmup, 1))

    async def one(req: BenchRequest) -> None:
        async with slots:
            await target.send(req, RequestRecord(-1, req.prompt_len, req.max_tokens, 0.0))

    await asyncio.gather(*(one(next(requests)) for _ in range(load.warmup)))


@dataclass(frozen=True, slots=True)
class Share:
    """This process's part of a load spread over ``of`` processes (``--processes``): the
    requests whose index is ``index`` modulo ``of``, every process drawing the same workload and
    arrival times; ``t0``: the common start (``time.perf_counter()``, one clock for every process
    of the host), None: now."""

    index: int = 0
    of: int = 1
    t0: float | None = None

    def mine(self, request_index: int) -> bool:
        return request_index % self.of == self.index

    def concurrency(self, total: int) -> int:
        """This process's part of ``--max-concurrency``."""
        return total // self.of + (self.index < total % self.of)


async def run_load(
    target,
    requests: Iterator[BenchRequest],
    load: Load,
    on_done: Callable[[RequestRecord], object] = lambda r: None,
    on_start: Callable[[], object] = lambda: None,
    share: Share = Share(),
) -> tuple[list[RequestRecord], float]:
    """Run the load on ``target`` (its ``now()`` restarts at the measured part's start):
    (the records in sending order, the run's duration: from its start to the last end).
    ``share``: this process's part of a load several processes send."""
    load.check()
    if load.warmup and share.index == 0:  # one process warms the server up
        await _warmup(target, requests, load)
    elif load.warmup:
        for _ in range(load.warmup):  # the others skip the same requests
            next(requests)
    # NOTE: a workload may build its prompts on its first request (shared-prefix: every system
    # prompt): done now, not at the start, where it would make the first sends late.
    requests = itertools.chain([next(requests)], requests)
    # (before the start: its full collection is slow)
    async with young_collections_only(timer=False) as collector:
        if share.t0 is not None and (wait := share.t0 - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        return await _open_loop(target, requests, load, on_done, on_start, share, collector)


async def _open_loop(
    target,
    requests: Iterator[BenchRequest],
    load: Load,
    on_done: Callable[[RequestRecord], object],
    on_start: Callable[[], object],
    share: Share,
    collector: YoungCollector,
) -> tuple[list[RequestRecord], float]:
    """``run_load``'s measured part: each request sent at its arrival time (or a slot); the
    young collections in the gaps between this process's sends."""
    target.t0 = share.t0 if share.t0 is not None else time.perf_counter()
    on_start()
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task] = set()
    slots = None
    if load.max_concurrency:
        slots = asyncio.Semaphore(max(share.concurrency(load.max_concurrency), 1))
    closed_loop = math.isinf(load.request_rate)

    async def one(req: BenchRequest, record: RequestRecord, held: bool) -> None:
        try:
            if slots is not None and not held:
                async with slots:
                    await target.send(req, record)
            else:
                await target.send(req, record)
        finally:
            if held and slots is not None:
                slots.release()
            on_done(record)

    times = arrival_times(load.request_rate, load.burstiness, load.seed)
    for index, due in enumerate(times):
        if load.num_requests is not None and index >= load.num_requests:
            break
        if load.duration is not None and due >= load.duration:
            break
        if not share.mine(index):
            next(requests)  # another process's: the same workload in every process
            continue
        if (wait := due - target.now()) > 0:
            collector.in_gap(wait)
            if (wait := due - target.now()) > 0:
                await asyncio.sleep(wait)
        held = False
        if closed_loop and slots is not None:  # wait for a slot here: no unbounded queue
            await slots.acquire()
            held = True
            if load.duration is not None and target.now() >= load.duration:
                slots.release()
                break
            due = target.now()
        req = next(requests)
        record = RequestRecord(index, req.prompt_len, req.max_tokens, arrival=due)
        records.append(record)
        task = asyncio.create_task(one(req, record, held))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    duration = max((r.end for r in records), default=target.now())
    return records, max(duration, 1e-9)


async def run_users(
    target,
    make_user: Callable[[int], Any],
    num_users: int,
    think_time: float,
    load: Load,
    on_done: Callable[[RequestRecord], object] = lambda r: None,
    share: Share = Share(),
) -> tuple[list[RequestRecord], float]:
    """``num_users`` users (``make_user(u)``: a ``workloads.ConversationUser``), each sending a
    turn, waiting for its answer, thinking (exponential, mean ``think_time`` seconds) and
    sending the next with the answer in its history, until ``load``'s duration or request count.
    This process runs the users ``share`` gives it; starts are spread over one think time."""
    if load.num_requests is None and load.duration is None:
        raise ValueError("give --num-requests or --duration")
    if share.of > num_users:
        raise ValueError(
            f"--processes {share.of} is more than the {num_users} users (--conversations)"
        )
    async with young_collections_only():  # (before the start: its full collection is slow)
        if share.t0 is not None and (wait := share.t0 - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        target.t0 = share.t0 if share.t0 is not None else time.perf_counter()
        records: list[RequestRecord] = []
        sent = 0

        def more() -> bool:
            if load.duration is not None and target.now() >= load.duration:
                return False
            return load.num_requests is None or sent < share.concurrency(load.num_requests)

        async def user_loop(u: int) -> None:
            nonlocal sent
            rng = random.Random(load.seed * 1_000_003 + u)
            user = make_user(u)
            await asyncio.sleep(rng.uniform(0, think_time))
            while more():
                req = user.next()
                record = RequestRecord(
                    len(records) * share.of + share.index,
                    req.prompt_len,
                    req.max_tokens,
                    arrival=target.now(),
                    turn=user.turn,
                    new_tokens=user.new_tokens,
                )
                record.answer = "" if isinstance(req.prompt, str) else []
                records.append(record)
                sent += 1
                await target.send(req, record)
                if record.ok:
                    user.answered(record.answer)
                else:
                    user.failed()
                record.answer = None  # (fed back; not kept)
                on_done(record)
                if think_time > 0 and more():  # (no think time after the last turn of the run)
                    pause = rng.expovariate(1 / think_time)
                    if load.duration is not None:
                        pause = min(pause, max(load.duration - target.now(), 0.0))
                    await asyncio.sleep(pause)

        await asyncio.gather(*(user_loop(u) for u in range(num_users) if share.mine(u)))
        duration = max((r.end for r in records), default=target.now())
        return records, max(duration, 1e-9)
