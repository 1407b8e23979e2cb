"""Which leading blocks of a prompt each node already holds, per the prefix index in Redis, and
what they are worth there (``CachedPrefix``: a block in a node's accelerator pool is free, one in
a tier behind it costs its load, priced against computing it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from splitserve.kvstore import BlockHash, hash_request_tokens
from splitserve.kvstore.host_cache import DISK, HOST
from splitserve.kvstore.redis_index import Held, PrefixIndex

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 0.5  # a slower index is treated as unreachable: routing must not wait on it


class LookupBatcher:
    """Coalesces the prefix-index lookups of concurrent requests: the first lookup goes out at
    once; those arriving while it is in flight go together in the next pipeline. A burst of
    requests then costs a few Redis round trips on one connection instead of one each (and a
    connection each: the pool would grow to the burst)."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._queue: list[tuple[list[str], Sequence[bytes], asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def lookup(self, node_ids: list[str], hashes: Sequence[bytes]) -> dict[str, Held]:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((node_ids, hashes, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                results = await self._index.held_prefixes_many([(n, h) for n, h, _ in batch])
            except Exception as exc:  # every caller hears of it (and routes by load)
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            except BaseException:  # cancelled (the router is stopping): nobody waits forever
                for *_, future in batch:
                    future.cancel()
                raise
            for (*_, future), result in zip(batch, results, strict=True):
                if not future.done():  # the caller may have timed out
                    future.set_result(result)


class PrefixLookup:
    """The cached prefix of a prompt on every node, or nothing while Redis is unreachable (the
    router then routes by load alone, and says so once)."""

    def __init__(self, index: PrefixIndex, block_size: int) -> None:
        self._index = index
        self._batcher = LookupBatcher(index)
        self._block_size = block_size
        self._ok = True

    def block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str) -> list[BlockHash]:
        """The prompt's block hashes as the nodes compute them (the index's root)."""
        return hash_request_tokens(
            prompt_token_ids, self._block_size, self._index.root_hash, cache_salt or None
        )

    async def cached_blocks(
        self, hashes: Sequence[BlockHash], addresses: list[str]
    ) -> dict[str, Held]:
        """Node address → leading blocks of the prompt (``block_hashes``) it holds, by tier (one
        round trip)."""
        if not hashes:
            return {}
        try:
            cached = await asyncio.wait_for(
                self._batcher.lookup(addresses, hashes), LOOKUP_TIMEOUT_S
            )
        except Exception as exc:  # Redis down or slow, or anything else: route by load
            if self._ok:
                logger.warning("prefix index unreachable (%s): routing by load only", exc)
            self._ok = False
            return {}
        if not self._ok:
            logger.info("prefix index reachable again")
        self._ok = True
        return cached


class NodeRates(Protocol):
    """What pricing a node's tiers needs of the router's record of it (``router.pool.Node``)."""

    @property
    def tier_block_load_s(self) -> Mapping[str, float]: ...

    def prefill_tokens_per_s(self) -> float | None: ...


def block_worth(tier: str, node: NodeRates | None, block_size: int) -> float:
    """The share of a block's computation that loading it from ``tier`` on ``node`` saves: 1
    minus its measured load time over the time the node takes to compute a block (its measured
    prefill rate), at least 0 (a tier slower than computing is worth nothing). Either figure not
    measured yet: 1 (as a block in the pool)."""
    if node is None:
        return 1.0
    load_s = node.tier_block_load_s.get(tier)
    rate = node.prefill_tokens_per_s()
    if load_s is None or not rate:
        return 1.0
    return max(0.0, 1.0 - load_s / (block_size / rate))


class CachedPrefix(dict[str, float]):
    """Node address → the leading blocks of a prompt it holds, priced: what holding them saves,
    in blocks of computation (a block in the accelerator pool counts 1, one in the host tier or
    on disk ``block_worth``). ``held`` keeps the index's counts by tier (a peer fetch reads a
    peer's pool and host-tier blocks, not its disk: ``peer_blocks``)."""

    def __init__(
        self,
        held: Mapping[str, Held] | None = None,
        nodes: Mapping[str, NodeRates] | None = None,
        block_size: int = 16,
    ) -> None:
        self.held: dict[str, Held] = dict(held or {})
        nodes = nodes or {}
        priced = {}
        for address, h in self.held.items():
            node = nodes.get(address)
            priced[address] = (
                h.device
                + h.host * block_worth(HOST, node, block_size)
                + h.disk * block_worth(DISK, node, block_size)
            )
        super().__init__(priced)

    def peer_blocks(self, address: str) -> int:
        """Leading blocks of the prompt ``address`` can send a peer: in its accelerator pool or
        its host tier's memory (not on its disk)."""
        held = self.held.get(address)
        return held.device + held.host if held is not None else 0
