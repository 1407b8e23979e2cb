"""How late the router's event loop runs what is due: the wait a request had before its handler.

A call that reached the host waits for the event loop before its handler runs (grpc.aio hands
the handler to the loop, which may be busy relaying tokens); the router's clock for a request
starts only there. ``LoopLag`` measures that wait from outside: a probe asks to wake every
``interval_s`` and records how much later it woke. The recent worst lateness is what a request
arriving now waited before its handler (an estimate: it is the same queue of callbacks), so the
front takes a request's arrival as ``now - lag`` (its deadline, its TTFT, admission's targets
count from there) and refuses at once, as ``router_busy``, while the lag alone is past
``--max-loop-lag-s``: a router that falls behind sheds load instead of serving it late.
"""

from __future__ import annotations

import asyncio
from collections import deque

INTERVAL_S = 0.01  # a probe every 10 ms
WINDOW = 25  # the lag is the worst of the last 25 probes (~0.25 s when the loop keeps up)


class LoopLag:
    """The event loop's recent lateness, in seconds (``seconds``); 0 until ``run`` runs."""

    def __init__(self, interval_s: float = INTERVAL_S, window: int = WINDOW) -> None:
        self._interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self.seconds = 0.0

    def note(self, late_s: float) -> None:
        """One probe's lateness."""
        self._samples.append(max(late_s, 0.0))
        self.seconds = max(self._samples)

    async def run(self) -> None:
        """Probe until cancelled (a task of the router's, beside its server)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self._interval_s
            await asyncio.sleep(self._interval_s)
            self.note(loop.time() - due)
