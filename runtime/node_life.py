"""A serving node's background work and its end: the publisher of its cached blocks and
heartbeat to Redis, leaving the registry, and ``NodeLife`` (drain on the first signal, stop once
the server has stopped). ``runtime.node.serve_node`` puts them together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.runtime.auth import read_token_file, registry_key
from splitserve.runtime.config import NodeConfig

if TYPE_CHECKING:
    from splitserve.engine.api import NodeEngine
    from splitserve.kvstore import ModelIdentity
    from splitserve.kvstore.block_pool import BlockStored, KVCacheEvent
    from splitserve.kvstore.redis_index import IndexPublisher, NodeInfo
    from splitserve.runtime.metrics import LoadFigures

logger = logging.getLogger(__name__)

WITHDRAW_TIMEOUT_S = 5.0  # a draining node waits this long to leave the registry and the index


class NodeService(Protocol):
    """What ``serve_node`` needs of a node's servicer (PrefillService, DecodeService)."""

    draining: bool

    async def drain(self, timeout_s: float) -> None: ...

    def load(self) -> LoadFigures: ...

    def all_counters(self) -> dict[str, float]: ...

    def background(self) -> list[Coroutine[Any, Any, None]]: ...

    async def close(self) -> None: ...


def index_publisher(
    config: NodeConfig, role: str, engine: NodeEngine, identity: ModelIdentity, address: str
) -> IndexPublisher | None:
    """The node's publisher of its cached block hashes and heartbeat (None without Redis)."""
    if not config.redis_url:
        return None
    from splitserve.kvstore.redis_index import IndexPublisher, NodeInfo, PrefixIndex

    async def take_events() -> list[KVCacheEvent]:
        return await engine.take_events()

    async def snapshot() -> list[BlockStored]:
        return await engine.cache_snapshot()

    async def info() -> NodeInfo:
        figures = await engine.figures()  # read without waiting for a step
        return NodeInfo(
            address,
            role,
            address,
            figures.num_blocks,
            figures.num_free_blocks,
            figures.running,
            figures.waiting,
        )

    return IndexPublisher(
        PrefixIndex(
            config.redis_url,
            identity.root_hash,
            identity=str(identity),
            key=registry_key(read_token_file(config.auth_token_file))
            if config.auth_token_file
            else None,
        ),
        address,
        take_events,
        snapshot,
        info,
    )


class NodeLife:
    """A serving node's background work (the service's tasks, the index publisher) and its end:
    ``drain`` on the first signal, ``stop`` once the server has stopped."""

    def __init__(
        self,
        config: NodeConfig,
        service: NodeService,
        engine: NodeEngine,
        publisher: IndexPublisher | None,
    ) -> None:
        self.drain_timeout_s = config.drain_timeout_s
        self.service, self.engine = service, engine
        self.tasks = [asyncio.create_task(c) for c in service.background()]
        self.publishing = (
            (asyncio.create_task(publisher.run()), publisher) if publisher is not None else None
        )

    async def withdraw(self) -> None:
        """Leave the registry and the index (once)."""
        if self.publishing is not None:
            (task, publisher), self.publishing = self.publishing, None
            await leave_registry(task, publisher)

    async def drain(self) -> None:
        self.service.draining = True
        await self.withdraw()
        await self.service.drain(self.drain_timeout_s)

    async def stop(self) -> None:
        await self.withdraw()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.engine.stop()
        await self.service.close()


async def leave_registry(publishing: asyncio.Task, publisher: IndexPublisher) -> None:
    """Stop publishing, then deregister and withdraw the node's index entries. NOTE: bounded: a
    drain must go on even if Redis (or a connection a cancelled command left behind) does not
    answer; the entries then expire with their TTL, and routers still sending here are refused
    with UNAVAILABLE and retry elsewhere."""

    async def leave() -> None:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        await publisher.stop()

    try:
        await asyncio.wait_for(leave(), WITHDRAW_TIMEOUT_S)
    except TimeoutError:
        logger.warning(
            "leaving the registry took over %.0f s: its entries expire on their own",
            WITHDRAW_TIMEOUT_S,
        )
