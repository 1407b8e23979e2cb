"""Greedy streams through a router with something done to the cluster mid-answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitserve.client import AsyncClient


async def stream_through(
    address: str, prompts: list[list[int]], max_tokens: int, midway: Callable[[], None]
) -> list[list[int]]:
    """Stream every prompt at once (greedy, ignore_eos); call ``midway()`` once every stream has
    had tokens and none has all of them (asserted); return each stream's tokens."""
    async with AsyncClient(address) as client:
        seen = [0] * len(prompts)
        started = asyncio.Event()

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for chunk in client.stream(
                prompt_token_ids=prompts[i],
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                timeout=120,
            ):
                tokens.extend(chunk.token_ids)
                seen[i] = len(tokens)
                if all(seen):
                    started.set()
            return tokens

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        await asyncio.wait_for(started.wait(), 60)
        midway()
        assert not all(t.done() for t in tasks)
        return await asyncio.gather(*tasks)
