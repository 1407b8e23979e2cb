"""Ending a decode node's request to the end, whatever interrupts it (``AsyncEngine.call_to_end``
says why a plain ``await engine.call(...)`` is not enough), and the signal that blocks were freed.
"""

from __future__ import annotations

import asyncio
import contextlib

from splitserve.engine.core import LLMEngine
from splitserve.engine.loop import AsyncEngine


async def end_request(engine: AsyncEngine, request_id: str) -> bool:
    """Drop a decoding (or never started, or still prefilling) request and free every block held
    under its id, to the end; True if it was still running. The next engine step drops it before
    scheduling, even while other engine jobs are queued ahead of this one
    (``LLMEngine.abort_soon``)."""
    engine.engine.abort_soon(request_id)
    return await engine.call_to_end(_end_request, engine.engine, request_id)


def _end_request(core: LLMEngine, request_id: str) -> bool:
    """Engine thread. ``abort`` frees a running request's blocks; a request whose
    ``add_transferred`` never ran still holds its adopted blocks under its id: free those too."""
    running = request_id in core.requests
    core.abort(request_id)
    core.kv_port.free(request_id)
    return running


class Signal:
    """Wakes every waiter when blocks are freed. Waiters also poll with a timeout, so a wake that
    is missed costs one poll, never a hang."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
