"""Greedy streams through a router with something done to the cluster mid-answer."""

from __future__ import annotations

import asyncio
import random
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


async def cancel_at_random_moments(target: str, rng: random.Random, n: int) -> list:
    """``n`` greedy streams through the router at ``target``, a third sharing a prefix, each
    cancelled at a random moment (half within 100 ms: in prefill or the transfer, the others
    up to 1.5 s: while decoding); what each ended with (``CancelledError`` for a cancelled one)."""
    shared = [rng.randrange(250) for _ in range(48)]  # a prefix several prompts ship at once

    async def one(client: AsyncClient, i: int) -> None:
        tail = [rng.randrange(250) for _ in range(rng.randrange(1, 60))]
        prompt = [*shared, *tail] if i % 3 == 0 else tail
        max_tokens = rng.randrange(2, 80)
        async for _ in client.stream(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            pass

    loop = asyncio.get_running_loop()
    async with AsyncClient(target) as client:
        tasks = []
        for i in range(n):
            task = asyncio.create_task(one(client, i))
            loop.call_later(rng.uniform(0, 0.1) if i % 2 else rng.uniform(0.1, 1.5), task.cancel)
            tasks.append(task)
            await asyncio.sleep(rng.uniform(0, 0.01))
        return await asyncio.gather(*tasks, return_exceptions=True)
