"""What every gRPC process of splitserve does the same way: health and reflection services, the
bound port written to a file for launchers, graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.config import NodeConfig

if TYPE_CHECKING:
    from kvstore import ModelIdentity
    from kvstore.redis_index import IndexPublisher
    from models.engine import LLMEngine
    from models.engine_loop import AsyncEngine

logger = logging.getLogger(__name__)

# Shipped KV blocks travel in messages of a few MB; allow generous headroom.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


# NOTE: no SO_REUSEPORT: a second process must fail to bind a taken port, not share it silently.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


class Server:
    def __init__(self, host: str, port: int, service_names: Sequence[str]) -> None:
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.service_names = tuple(service_names)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def start(self, port_file: str | None = None) -> None:
        """Start serving, mark SERVING, then write the bound port to ``port_file`` (atomically:
        a launcher polling it never reads half a number)."""
        await self.server.start()
        await self.set_serving(True)
        if port_file:
            tmp = Path(port_file).with_suffix(".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(port_file)
        logger.info("serving %s on %s", ", ".join(self.service_names), self.address)

    async def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING first (so health checks steer traffic away), then a graceful stop."""
        await self.set_serving(False)
        await self.server.stop(grace_s)

    async def run(
        self,
        port_file: str | None = None,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        grace_s: float = 5.0,
        drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start, serve until SIGTERM/SIGINT, drain, stop, then ``on_stop``.

        On the first signal health turns NOT_SERVING and ``drain`` runs (it stops taking work and
        waits for in-flight requests); a second signal cuts the drain short.
        """
        await self.start(port_file)
        signals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        await signals.get()
        await self.set_serving(False)
        if drain is not None:
            logger.info("draining %s", self.address)
            draining = asyncio.create_task(drain())
            again = asyncio.create_task(signals.get())
            await asyncio.wait((draining, again), return_when=asyncio.FIRST_COMPLETED)
            if not draining.done():
                logger.warning("second signal: not waiting for in-flight requests")
                draining.cancel()
            again.cancel()
            await asyncio.gather(draining, again, return_exceptions=True)
        logger.info("stopping %s", self.address)
        await self.stop(grace_s)
        if on_stop is not None:
            await on_stop()


def build_engine(config: NodeConfig, prefill_only: bool) -> tuple[LLMEngine, ModelIdentity]:
    """Load the model of a node and wrap it in an engine (blocking: call before serving)."""
    import torch

    from kvstore import ModelIdentity
    from models.engine import LLMEngine
    from models.loader import load_model
    from models.runner import ModelRunner, RunnerConfig

    if config.device == "cpu":
        # Several node processes share the machine's cores; one thread each avoids thrashing.
        torch.set_num_threads(1)
    model_config, model = load_model(
        config.model_path,
        dtype=config.dtype,
        device=config.device,
        load_format=config.load_format,
    )
    runner = ModelRunner(
        model_config,
        model,
        RunnerConfig(
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_bytes=None if config.device.startswith("cuda") else config.kv_cache_mb << 20,
        ),
    )
    identity = ModelIdentity.for_checkpoint(config.model_path, str(runner.dtype), config.block_size)
    engine = LLMEngine(
        runner,
        identity,
        prefill_only=prefill_only,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_kv_events=config.redis_url is not None,
    )
    return engine, identity


def index_publisher(
    config: NodeConfig, role: str, engine: AsyncEngine, identity: ModelIdentity, address: str
) -> IndexPublisher | None:
    """The node's publisher of its cached block hashes and heartbeat (None without Redis)."""
    if not config.redis_url:
        return None
    from kvstore.redis_index import IndexPublisher, NodeInfo, PrefixIndex

    core = engine.engine

    async def take_events():
        return await engine.call(core.pool.take_events)

    async def snapshot():
        return await engine.call(lambda: list(core.pool.cached_block_hash_to_block))

    async def info():
        return NodeInfo(
            address,
            role,
            address,
            core.pool.num_blocks - 1,
            core.pool.num_free_blocks,
            len(core.running),
            len(core.waiting),
        )

    return IndexPublisher(
        PrefixIndex(config.redis_url, identity.root_hash, identity=str(identity)),
        address,
        take_events,
        snapshot,
        info,
    )


async def serve_node(config: NodeConfig, role: str, make_service, add_servicer, service_name: str):
    """Run one prefill or decode node until SIGTERM/SIGINT, then drain it.

    ``make_service(engine, identity, config, address)`` builds the servicer (``address``: the
    node's advertised host:port, its id in Redis). The servicer provides ``draining``,
    ``drain(timeout_s)``, ``load()`` (LoadFigures), ``all_counters()``, ``background()``
    (coroutines to run while serving) and ``close()``.

    Drain: health NOT_SERVING, the node leaves the registry and withdraws its index entries (no
    router sends it new work), new work is refused with UNAVAILABLE (the router retries
    elsewhere), in-flight requests finish (up to ``drain_timeout_s``), then the process exits 0.
    """
    engine, identity = build_engine(config, prefill_only=role == "prefill")
    logger.info("%s node: %s", role, identity)
    from models.engine_loop import AsyncEngine

    loop_engine = AsyncEngine(engine)
    loop_engine.start()
    server = Server(config.host, config.port, [service_name])
    address = f"{config.advertised_host()}:{server.port}"
    service = make_service(loop_engine, identity, config, address)
    add_servicer(service, server.server)
    if config.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from splitserve.metrics import NodeCollector, serve_metrics

        registry = CollectorRegistry()
        registry.register(NodeCollector(role, service.load, service.all_counters))
        serve_metrics(config.metrics_port, registry, config.host)
    publisher = index_publisher(config, role, loop_engine, identity, address)
    tasks = [asyncio.create_task(c) for c in service.background()]
    publishing = asyncio.create_task(publisher.run()) if publisher else None

    async def withdraw() -> None:
        nonlocal publishing
        if publishing is not None:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)
            publishing = None
            await publisher.stop()  # deregisters and withdraws the index entries

    async def drain() -> None:
        service.draining = True
        await withdraw()
        await service.drain(config.drain_timeout_s)

    async def on_stop() -> None:
        await withdraw()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await loop_engine.stop()
        await service.close()

    await server.run(config.port_file, on_stop, drain=drain)


def transfer_paths(config: NodeConfig) -> tuple[str, ...]:
    """The KV transfer paths a node may use (``--kv-transfer``); gRPC bytes always remain."""
    from transfer import DIST, GRPC, IPC

    names = [p.strip() for p in config.kv_transfer.split(",") if p.strip()]
    if names == ["none"]:
        return (GRPC,)
    unknown = set(names) - {IPC, DIST, GRPC}
    if unknown:
        raise ValueError(f"--kv-transfer: unknown path(s) {sorted(unknown)}; use ipc, dist or none")
    if not config.device.startswith("cuda"):
        names = [p for p in names if p != IPC]  # ipc maps CUDA memory only
    return (*[p for p in (IPC, DIST) if p in names], GRPC)


def node_stats(role: str, engine, identity: ModelIdentity, load, counters, **extra):
    """A node's ``GetStats`` answer: its identity, load figures (splitserve.metrics.LoadFigures)
    and counters; ``extra``: role-specific fields."""
    from proto import nodes_pb2

    return nodes_pb2.NodeStats(
        role=role,
        model_root_hash=identity.root_hash,
        model_identity=str(identity),
        num_blocks=load.num_blocks,
        num_free_blocks=load.num_free_blocks,
        num_cached_blocks=engine.pool.num_cached_blocks,
        running=load.running,
        waiting=load.waiting,
        prefill_tokens_waiting=load.prefill_tokens_waiting,
        pending_transfers=load.pending_transfers,
        counters=counters,
        **extra,
    )
