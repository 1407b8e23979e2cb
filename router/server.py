"""The router process: ``Router`` + grpc.health.v1 + reflection on one grpc.aio server."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import router_pb2, router_pb2_grpc
from router.registry import NodeRegistry
from router.request import ModelInfo
from router.service import RouterService
from splitserve.config import RouterConfig
from splitserve.serving import SERVER_OPTIONS

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # in-flight streams get this long to finish on SIGTERM


def write_port_file(path: str | Path, port: int) -> None:
    """Atomically (a reader never sees a half-written file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


async def start_router(
    config: RouterConfig, model: ModelInfo
) -> tuple[grpc.aio.Server, NodeRegistry, health.aio.HealthServicer, int]:
    """Build and start the server; returns it with its registry, health servicer and port."""
    registry = NodeRegistry(config.prefill_addresses, config.decode_addresses)
    service = RouterService(
        model,
        registry,
        max_attempts=config.max_attempts,
        request_timeout_s=config.request_timeout_s,
    )
    server = grpc.aio.server(options=SERVER_OPTIONS)
    router_pb2_grpc.add_RouterServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    reflection.enable_server_reflection(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot listen on {config.host}:{config.port}")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, registry, health_servicer, port


async def _serve(config: RouterConfig) -> None:
    model = ModelInfo.load(config.model_path)
    server, registry, health_servicer, port = await start_router(config, model)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    checker = asyncio.create_task(registry.run_health_checks())
    logger.info(
        "router serving on %s:%d (prefill: %s; decode: %s)",
        config.host,
        port,
        ", ".join(config.prefill_addresses),
        ", ".join(config.decode_addresses),
    )
    if config.port_file:
        write_port_file(config.port_file, port)
    try:
        await stop.wait()
    finally:
        logger.info("router stopping (grace %.0f s)", GRACE_S)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(GRACE_S)
        checker.cancel()
        await asyncio.gather(checker, return_exceptions=True)
        await registry.close()


def serve(config: RouterConfig) -> None:
    """Serve until SIGTERM/SIGINT (blocking)."""
    asyncio.run(_serve(config))
