"""The router process: ``Router`` + grpc.health.v1 + reflection on one grpc.aio server."""

from __future__ import annotations

import asyncio
import logging

from proto import router_pb2, router_pb2_grpc
from router.registry import NodeRegistry
from router.request import ModelInfo
from router.service import RouterService
from splitserve.config import RouterConfig
from splitserve.serving import Server

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # in-flight streams get this long to finish on SIGTERM
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def build_router(config: RouterConfig, model: ModelInfo) -> tuple[Server, NodeRegistry]:
    """The router's server (Router + health + reflection), not started yet."""
    registry = NodeRegistry(config.prefill_addresses, config.decode_addresses)
    service = RouterService(
        model,
        registry,
        max_attempts=config.max_attempts,
        request_timeout_s=config.request_timeout_s,
    )
    server = Server(config.host, config.port, [SERVICE_NAME])
    router_pb2_grpc.add_RouterServicer_to_server(service, server.server)
    return server, registry


async def start_router(config: RouterConfig, model: ModelInfo) -> tuple[Server, NodeRegistry]:
    """Build and start (for tests and embedding); stop with ``server.stop()``."""
    server, registry = build_router(config, model)
    await server.start(config.port_file)
    return server, registry


async def _serve(config: RouterConfig) -> None:
    server, registry = build_router(config, ModelInfo.load(config.model_path))
    checker = asyncio.create_task(registry.run_health_checks())
    logger.info(
        "router on %s (prefill: %s; decode: %s)",
        server.address,
        ", ".join(config.prefill_addresses),
        ", ".join(config.decode_addresses),
    )

    async def on_stop() -> None:
        checker.cancel()
        await asyncio.gather(checker, return_exceptions=True)
        await registry.close()

    await server.run(config.port_file, on_stop, grace_s=GRACE_S)


def serve(config: RouterConfig) -> None:
    """Serve until SIGTERM/SIGINT (blocking)."""
    asyncio.run(_serve(config))
