"""Requests whose KV has arrived, waiting for the router's decode command.

An entry that is not claimed by its deadline (the router died, the client left between prefill
and decode) is dropped and its blocks freed, so an orphaned transfer cannot hold the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from splitserve.models.sampling_params import SamplingParams

EXPIRY_POLL_S = 1.0
# Ids released before their transfer was adopted (the router gave up on the request while P was
# still shipping): remembered this long, at most this many, so the KV that lands later is freed
# at once instead of at its transfer deadline.
RELEASED_KEEP_S = 60.0
RELEASED_MAX = 4096
# A draining node holds an adopted request this long for its decode command (the router makes it
# right after the prefill answered): one whose client has gone must not hold the drain for the
# whole transfer deadline.
DRAIN_HOLD_S = 5.0


@dataclass(slots=True)
class Pending:
    """A request whose KV is adopted, waiting for its decode command."""

    prompt: list[int]
    first_token: int
    params: SamplingParams
    cache_salt: str | None
    deadline: float  # time.monotonic()


class PendingTable:
    def __init__(self) -> None:
        self._items: dict[str, Pending] = {}
        self._released: dict[str, float] = {}  # id → when released (insertion order: oldest first)
        self._hold_until: float | None = None  # draining: no entry is held past this

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request_id: str, pending: Pending) -> None:
        """Hold ``pending`` for its decode command; one released already expires at the next poll
        (its blocks are freed there, within ``EXPIRY_POLL_S``)."""
        if self._released.pop(request_id, None) is not None:
            pending.deadline = 0.0
        if self._hold_until is not None:
            pending.deadline = min(pending.deadline, self._hold_until)
        self._items[request_id] = pending

    def hold_at_most(self, seconds: float) -> None:
        """The node drains: hold no entry, present or future, more than ``seconds`` from now."""
        self._hold_until = time.monotonic() + seconds
        for pending in self._items.values():
            pending.deadline = min(pending.deadline, self._hold_until)

    def pop(self, request_id: str) -> Pending | None:
        return self._items.pop(request_id, None)

    def release(self, request_id: str) -> Pending | None:
        """The router gave the request up: its entry if it has one; else remember the id (for a
        while, a bounded number) so that a transfer adopted later is freed at once."""
        pending = self._items.pop(request_id, None)
        if pending is None:
            now = time.monotonic()
            released = self._released
            released[request_id] = now
            while released and (
                len(released) > RELEASED_MAX
                or next(iter(released.values())) < now - RELEASED_KEEP_S
            ):
                del released[next(iter(released))]
        return pending

    def take_expired(self, now: float) -> list[str]:
        """Remove and return the ids whose deadline has passed."""
        expired = [rid for rid, p in self._items.items() if p.deadline < now]
        for rid in expired:
            del self._items[rid]
        return expired

    async def expire_forever(
        self, free: Callable[[str], Awaitable[None]], on_expired: Callable[[], None]
    ) -> None:
        """Every second: drop expired entries, ``on_expired()`` and ``free(request_id)`` each."""
        while True:
            await asyncio.sleep(EXPIRY_POLL_S)
            for rid in self.take_expired(time.monotonic()):
                on_expired()
                await free(rid)
