"""AsyncEngine: drives an LLMEngine from asyncio, for the gRPC nodes.

Every engine operation (steps, adds, aborts, KV reads and writes) runs on one dedicated thread, in
the order submitted, so the engine needs no locks and the event loop never blocks on the model.
Per-request outputs are delivered through asyncio queues.

Releases must happen whatever interrupts them. ``await call(free, rid)`` is not enough: cancelling
the awaiting task (a client cancel, then the call torn down while it cleans up) cancels the
executor job too, and a job still queued behind a step is then dropped — the blocks stay
allocated for good. Releases, reservations and pins therefore go through ``call_to_end`` (or
``acquire``), which queue the job first and wait for it through any number of cancellations.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from splitserve.models.engine import LLMEngine, RequestDoesNotFit, StepOutput
from splitserve.models.kv_port import KVPort

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        device = engine.runner.device if engine is not None else None
        # NOTE: CUDA's current device is per thread, and Triton launches on it: the engine thread
        # must make the node's GPU current itself (a node on cuda:1 whose steps ran with cuda:0
        # current would launch its kernels on the wrong GPU).
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="engine",
            initializer=_bind_device,
            initargs=(device,),
        )
        self._queues: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    @property
    def kv_port(self) -> KVPort:
        """The engine's KV port (its methods run on the engine thread: pass them to ``call``)."""
        return self.engine.kv_port

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` on the engine thread, between steps."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def submit(self, fn: Callable[..., T], *args) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` on the engine thread now. Cancelling the future drops a job still
        queued behind a step (harmless for a read, a leak for a release): await it with
        ``settle`` or shielded where the job must run."""
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def call_to_end(self, fn: Callable[..., T], *args) -> T:
        """``call`` that a cancellation of the caller cannot stop half way: ``fn`` runs, and the
        cancellation is raised once it has (so the caller's cleanup goes on in order). For
        releases (make them idempotent: a caller may retry one that already ran) and for
        allocations whose result the caller must free if it is cancelled."""
        return await settle(self.submit(fn, *args))

    async def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks, to the end whatever cancels the caller
        (``call_to_end``). It takes effect before the next step schedules, even when other
        engine calls (or the next step) are queued ahead of the abort job: only the step
        already running when it is called still computes the request. Idempotent."""
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
        self._wakeup.set()
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def notify(self) -> None:
        """New work was added: run steps."""
        self._wakeup.set()

    async def _run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await self.call(engine.step)
            except RequestDoesNotFit as exc:
                queue = self._queues.get(exc.request_id)
                if queue is not None:
                    queue.put_nowait(exc)
                continue
            except Exception as exc:  # a failed step fails its requests, not the node
                logger.exception("engine step failed")
                for rid in [
                    r.request_id for r in (*engine.running, *engine.waiting, *engine.ready)
                ]:
                    await self.call(engine.abort, rid)
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(exc)
                continue
            if engine.last_num_scheduled:
                self.steps += 1  # forwards run (not the steps that found nothing to schedule)
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            if not outputs:
                # Nothing could be scheduled (the pool is held by transfers in flight): wait a
                # little instead of spinning; else just let the event loop run.
                await asyncio.sleep(0.002 if engine.last_num_scheduled == 0 else 0)


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
