"""AsyncEngine: drives an LLMEngine from asyncio, for the gRPC nodes.

Every engine operation (steps, adds, aborts, KV reads and writes) runs on one dedicated thread, in
the order submitted, so the engine needs no locks and the event loop never blocks on the model.
The thread steps on its own: between two steps it runs the jobs queued meanwhile, then starts the
next step at once, so the model never waits for the event loop. Each step's outputs reach the
loop in one callback, which hands them to per-request asyncio queues; the loop streams them while
the next step computes. (Driving each step from the loop instead left the GPU idle whenever the
loop was busy sending the previous step's tokens, which on a node with hundreds of streams is
most of the time.)

On a GPU a step's outputs are handed over once the next step's forward is queued on the device,
not before: the loop and the engine thread share the GIL, and a loop that wakes to stream 256
tokens holds it in bursts of milliseconds. Woken before the next step is prepared, it stretched
that preparation (Python, and torch calls that each give the GIL up and wait to get it back)
while the GPU idled: decode steps of 256 requests took 26-33 ms in a node against 16.5 ms in
process (docs/benchmarks-history.md, "A node's steps against the engine's: where the colocated
layout lost, and two fixes, one H200 (2026-12-01)"). Woken after the launch, its burst runs while
the GPU computes and the engine thread waits for the results. A token reaches the loop one
schedule-and-prepare later (~2-3 ms); when no step follows, at once. On the CPU the forward runs
inside the launch, so outputs are handed over at once.

Releases must happen whatever interrupts them. ``await call(free, rid)`` is not enough: cancelling
the awaiting task (a client cancel, then the call torn down while it cleans up) cancels the
queued job too, and a job still queued behind a step is then dropped — the blocks stay
allocated for good. Releases, reservations and pins therefore go through ``call_to_end`` (or
``acquire``), which queue the job first and wait for it through any number of cancellations.

``SPLITSERVE_MIN_STEP_MS``: every step that runs a forward takes at least this long (the thread
sleeps the rest, the GIL released, before its outputs are handed over), as on a slower device.
For load tests and demos on a shared CPU: a node whose steps sleep rather than compute runs at
the same rate however busy the machine's cores are (its forward must fit in the floor). Unset or
0: steps take what they take.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TypeVar

import splitserve.settings as settings
from splitserve.engine.core import LLMEngine, RequestDoesNotFit, StepOutput
from splitserve.engine.kv_port import KVPort

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A step that scheduled nothing although requests wait (the pool is held by transfers in flight):
# the thread waits this long, or until a job comes, instead of spinning.
IDLE_WAIT_S = 0.002
STOP_POLL_S = 0.01


def min_step_seconds(env: Mapping[str, str] | None = None) -> float:
    """``SPLITSERVE_MIN_STEP_MS`` in seconds (0: no floor); a clear error for a bad value."""
    return settings.MIN_STEP_MS.get(env) / 1000


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        profile_path: str | None = None,
        deliver: Callable[[list[StepOutput]], object] | None = None,
        fail: Callable[[list[str], BaseException], object] | None = None,
        on_thread: bool = False,
    ) -> None:
        """``profile_path``: time every step's phases (engine.step_profile) and write them
        there when stopped. ``deliver(outputs)`` / ``fail(request_ids, exc)``: where a step's
        outputs go (default: the queues of ``subscribe``), called on the event loop, or with
        ``on_thread`` on the engine thread itself (an engine process writing them out: no hop
        through its loop)."""
        self.engine = engine
        self._deliver_to = deliver or self._deliver
        self._fail_to = fail or self._fail
        self._on_thread = on_thread
        self._profile_path = profile_path
        self._profile = None
        self._min_step_s = min_step_seconds()
        if profile_path:
            from splitserve.engine.step_profile import StepProfile

            self._profile = StepProfile(engine)
        self._device = engine.runner.device
        # GPU: a step's outputs wait here until the next step's forward is launched (see above).
        # (An engine with asynchronous scheduling hands over a step's outputs after the next
        # step's launch already: nothing to hold back then.)
        self._defer_outputs = (
            self._device is not None and self._device.type == "cuda" and not engine.async_scheduling
        )
        self._held: list[StepOutput] | None = None
        self._jobs: deque[tuple[Future, Callable, tuple]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(): steps run then
        self._queues: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        self.steps = 0
        # Wall seconds the engine thread spent in steps that ran a forward, and in jobs: over a
        # run, step_seconds / steps is the mean step as the node sees it (GIL waits included),
        # and (step_seconds + job_seconds) / elapsed how busy the thread was.
        self.step_seconds = 0.0
        self.job_seconds = 0.0
        # NOTE: CUDA's current device is per thread, and Triton launches on it: the engine thread
        # must make the node's GPU current itself (a node on cuda:1 whose steps ran with cuda:0
        # current would launch its kernels on the wrong GPU).
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._thread.start()

    def counters(self) -> dict[str, float]:
        """The engine thread's monotonic counters, for a node's ``all_counters``: forwards run,
        and the wall seconds spent in them and in the jobs between them."""
        return {
            "steps": self.steps,
            "step_seconds": self.step_seconds,
            "engine_job_seconds": self.job_seconds,
        }

    @property
    def kv_port(self) -> KVPort:
        """The engine's KV port (its methods run on the engine thread: pass them to ``call``)."""
        return self.engine.kv_port

    def start(self) -> None:
        """Start stepping; outputs go to this event loop's queues."""
        self._loop = asyncio.get_running_loop()
        self.notify()

    async def stop(self) -> None:
        """Stop after the step or job in progress; jobs still queued are cancelled."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        # Polled, not joined in an executor thread: a step stuck for good (a tensor-parallel
        # rank stopped) must not leave a thread that the event loop's shutdown would wait on.
        while self._thread.is_alive():
            await asyncio.sleep(STOP_POLL_S)
        while self._jobs:
            self._jobs.popleft()[0].cancel()
        if self._profile is not None and self._profile_path:
            try:
                self._profile.dump(self._profile_path)
                logger.info("step profile written to %s", self._profile_path)
            except OSError as exc:
                logger.warning("cannot write the step profile to %s: %s", self._profile_path, exc)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` on the engine thread, between steps."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` on the engine thread now. Cancelling the future drops a job still
        queued behind a step (harmless for a read, a leak for a release): await it with
        ``settle`` or shielded where the job must run."""
        return asyncio.wrap_future(self.submit_threadsafe(fn, *args))

    def submit_threadsafe(self, fn: Callable[..., T], *args) -> Future:
        """``submit`` from any thread but the engine's own (which would wait for itself): a
        ``concurrent.futures.Future`` (cancelled when the engine is stopping)."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                future.cancel()
            else:
                self._jobs.append((future, fn, args))
                self._cond.notify()
        return future

    async def call_to_end(self, fn: Callable[..., T], *args) -> T:
        """``call`` that a cancellation of the caller cannot stop half way: ``fn`` runs, and the
        cancellation is raised once it has (so the caller's cleanup goes on in order). For
        releases (make them idempotent: a caller may retry one that already ran) and for
        allocations whose result the caller must free if it is cancelled."""
        return await settle(self.submit(fn, *args))

    async def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks, to the end whatever cancels the caller
        (``call_to_end``). It takes effect before the next step schedules, even when other
        engine calls are queued ahead of the abort job: only the step already running when it
        is called still computes the request. Idempotent."""
        self.engine.abort_soon(request_id)  # read at the top of every step
        await self.call_to_end(self.engine.abort, request_id)

    async def acquire(self, fn: Callable[..., T], undo: Callable[[T], object], *args) -> T:
        """Run ``fn(*args)`` on the engine thread and return what it took (e.g. pinned blocks);
        a caller cancelled before it hears the result has ``undo(result)`` queued for it as
        soon as ``fn`` is done, so nothing taken is left behind."""
        future = self.submit(fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:

            def undo_when_done(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    self.submit(undo, done.result())

            future.add_done_callback(undo_when_done)
            raise

    def subscribe(self, request_id: str) -> asyncio.Queue[StepOutput | BaseException]:
        queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.notify()
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def notify(self) -> None:
        """New work was added: wake the engine thread."""
        with self._cond:
            self._cond.notify()

    # ------------------------------------------------------------------ the engine thread

    def _main(self) -> None:
        _bind_device(self._device)
        engine = self.engine
        while True:
            with self._cond:
                while not (self._jobs or self._stopping or self._can_step()):
                    self._cond.wait()
                if self._stopping:
                    self._hand_over()
                    return
                jobs = list(self._jobs)
                self._jobs.clear()
            started = time.perf_counter()
            for future, fn, args in jobs:
                if not future.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)
            if jobs:
                self.job_seconds += time.perf_counter() - started
            if self._can_step() and not self._step(engine):
                with self._cond:  # nothing could be scheduled: wait a little, or for a job
                    if not self._jobs and not self._stopping:
                        self._cond.wait(IDLE_WAIT_S)
            if self._held is not None and not self._can_step():
                self._hand_over()  # no step follows to launch first

    def _can_step(self) -> bool:
        return self._loop is not None and self.engine.has_unfinished()

    def _step(self, engine: LLMEngine) -> bool:
        """One engine step, its outputs posted to the loop; False when nothing was scheduled."""
        started = time.perf_counter()
        launched = self._hand_over if self._held is not None else None
        try:
            if self._profile is None:
                outputs = engine.step(launched)
            else:
                outputs = self._profile.step(launched)
        except RequestDoesNotFit as exc:
            self._hand_over()
            self._post(self._fail_to, [exc.request_id], exc)
            return True
        except Exception as exc:  # a failed step fails its requests, not the node
            self._hand_over()
            logger.exception("engine step failed")
            queues = (*engine.running, *engine.waiting, *engine.ready, *engine.loading)
            rids = [r.request_id for r in queues]
            for rid in rids:
                engine.abort(rid)
            self._post(self._fail_to, rids, exc)
            return True
        self._hand_over()  # nothing launched (nothing scheduled): the last outputs go now
        if engine.last_num_scheduled and self._min_step_s:
            time.sleep(max(0.0, started + self._min_step_s - time.perf_counter()))
        if engine.last_num_scheduled:
            self.steps += 1  # forwards run (not the steps that found nothing to schedule)
            self.step_seconds += time.perf_counter() - started
        if outputs:
            if self._defer_outputs:
                self._held = outputs
            else:
                self._post(self._deliver_to, outputs)
        return bool(engine.last_num_scheduled)

    def _hand_over(self) -> None:
        """Post the outputs held back from the last step, if any."""
        held, self._held = self._held, None
        if held:
            self._post(self._deliver_to, held)

    def _post(self, fn: Callable, *args) -> None:
        if self._on_thread:
            try:
                fn(*args)
            except Exception:  # the engine thread goes on; the sink says what failed
                logger.exception("handing a step's outputs over failed")
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to hear
            self._loop.call_soon_threadsafe(fn, *args)  # pyright: ignore[reportOptionalMemberAccess] (set by start)

    # ------------------------------------------------------------------ on the event loop

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(exc)


async def settle(future: asyncio.Future[T]) -> T:
    """Await ``future`` to its end through any number of cancellations of the caller (for work
    that must not be abandoned half way: a release, a copy into another node's blocks), then
    raise the cancellation, if there was one, or return its result."""
    interrupted = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():  # the work itself was cancelled (the engine is stopping)
                raise
            interrupted = True
        except Exception:
            break  # raised below by result(), unless a cancellation is owed
    if interrupted:
        if not future.cancelled():
            future.exception()  # retrieved: the caller hears of its cancellation instead
        raise asyncio.CancelledError
    return future.result()


def _bind_device(device) -> None:
    """Engine thread: make the node's CUDA device current (nothing on CPU)."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
