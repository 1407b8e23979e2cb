"""Ending a decode node's request to the end, whatever interrupts it (``NodeEngine.end_request``
completes even when its caller is cancelled), and the signal that blocks were freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.api import NodeEngine


async def end_request(engine: NodeEngine, request_id: str) -> bool:
    """Drop a decoding (or never started, or still prefilling) request and free every block held
    under its id, to the end; True if it was still running. The engine drops it before its next
    step schedules, even while other engine work is queued ahead of the command."""
    return await engine.end_request(request_id)


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
