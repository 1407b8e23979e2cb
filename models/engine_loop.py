"""AsyncEngine: drives an LLMEngine from asyncio, for the gRPC nodes.

Every engine operation (steps, adds, aborts, KV reads and writes) runs on one dedicated thread, in
the order submitted, so the engine needs no locks and the event loop never blocks on the model.
Per-request outputs are delivered through asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from splitserve.models.engine import LLMEngine, RequestDoesNotFit, StepOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._queues: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

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
                for rid in [r.request_id for r in (*engine.running, *engine.waiting)]:
                    await self.call(engine.abort, rid)
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(exc)
                continue
            self.steps += 1
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            if not outputs:
                # Nothing could be scheduled (the pool is held by transfers in flight): wait a
                # little instead of spinning; else just let the event loop run.
                await asyncio.sleep(0.002 if engine.last_num_scheduled == 0 else 0)
