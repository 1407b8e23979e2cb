"""The signal that a decode node freed blocks (a request ended: ``NodeEngine.end_request``,
which completes even when its caller is cancelled; a transfer released)."""

from __future__ import annotations

import asyncio
import contextlib


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
