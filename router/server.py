"""The router process: ``RouterService`` + grpc.health.v1 + reflection on one grpc.aio server."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.router.api_keys import ApiKeys
from splitserve.router.assembly import build_front
from splitserve.router.config import RouterConfig
from splitserve.router.front import RequestFront
from splitserve.router.http import HttpFront, https_context
from splitserve.router.metrics import RouterMetrics
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import ModelInfo
from splitserve.router.service import RouterService
from splitserve.runtime.auth import read_token_file, registry_key, use_token
from splitserve.runtime.metrics import serve_metrics
from splitserve.runtime.server import Server, write_port_file
from splitserve.runtime.tls import TlsFiles, use_tls
from splitserve.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # in-flight streams get this long to finish on SIGTERM
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


def build_router(
    config: RouterConfig,
    model: ModelInfo,
    index: PrefixIndex | None = None,
    identity: ModelIdentity | None = None,
    metrics: RouterMetrics | None = None,
    keys: ApiKeys | None = None,
) -> tuple[Server, NodeRegistry, RequestFront]:
    """The router's server (Router + health + reflection), not started yet, and the request
    path an HTTP front shares. With ``identity``, nodes serving another model identity are
    never routed to; with ``keys`` (``api_keys``), a gRPC call needs one of them."""
    registry = NodeRegistry(
        config.prefill_addresses,
        config.decode_addresses,
        expected_identity=identity,
        decode_overcommit=config.decode_overcommit,
        decode_kv_headroom=config.decode_kv_headroom,
        prefill_queue_tokens=config.prefill_queue_tokens,
        share=config.capacity_share,
    )
    front = build_front(config, model, registry, index, metrics)
    tls = TlsFiles.load(config.tls_cert, config.tls_key, config.tls_ca)
    use_tls(tls)  # the router's channels to the nodes, too
    server = Server(
        config.host,
        config.port,
        [SERVICE_NAME],
        max_request_bytes=config.max_request_bytes,
        tls=tls,
        reuse_port=config.reuse_port,
    )
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterService(front, keys), server.server)
    return server, registry, front


def prefix_index(config: RouterConfig) -> PrefixIndex | None:
    """The index keyed by the same model identity the nodes compute (same checkpoint, dtype
    and block size), so the router's prompt hashes are the nodes' hashes by construction."""
    if not config.redis_url:
        return None
    identity = model_identity(config)
    logger.info("prefix index %s for %s", config.redis_url, identity)
    token = read_token_file(config.auth_token_file) if config.auth_token_file else None
    return PrefixIndex(
        config.redis_url, identity.root_hash, identity=str(identity), key=registry_key(token)
    )


def model_identity(config: RouterConfig) -> ModelIdentity:
    """What the nodes must serve: every node's root hash is checked against this one's. Built
    as the nodes build theirs (same checkpoint, dtype - None: the checkpoint's - and block size)."""
    return ModelIdentity.for_checkpoint(
        config.model_path,
        config.dtype,
        config.block_size,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
    )


async def start_router(config: RouterConfig, model: ModelInfo) -> tuple[Server, NodeRegistry]:
    """Build and start (for tests and embedding); stop with ``server.stop()``."""
    server, registry, _ = build_router(config, model, keys=api_keys(config))
    await server.start(config.port_file)
    return server, registry


async def _serve(config: RouterConfig, model: ModelInfo) -> None:
    # The nodes' internal services ask for the cluster token; the router's own stays public.
    use_token(read_token_file(config.auth_token_file) if config.auth_token_file else None)
    index = prefix_index(config)
    metrics = RouterMetrics()
    keys = api_keys(config)  # one key for both doors: the gRPC API and the HTTP API
    identity = model_identity(config)
    server, registry, front = build_router(config, model, index, identity, metrics, keys)
    await registry.check_all()  # static nodes: known up and identity-checked before serving
    http = await start_http(config, front, registry, keys)
    checker = asyncio.create_task(registry.run_health_checks())
    lag = asyncio.create_task(front.loop_lag.run()) if front.loop_lag is not None else None
    polls = None
    if config.metrics_port is not None:
        port = serve_metrics(config.metrics_port, metrics.registry, config.host)
        if config.metrics_port_file:
            write_port_file(config.metrics_port_file, port)
        polls = asyncio.create_task(registry.run_load_polls(metrics.nodes))
    logger.info(
        "router on %s (prefill: %s; decode: %s)",
        server.address,
        ", ".join(config.prefill_addresses) or "none",
        ", ".join(config.decode_addresses),
    )

    discovery = asyncio.create_task(registry.run_discovery(index)) if index else None

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        for task in (checker, discovery, polls, lag):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await registry.close()
        if index is not None:
            await index.close()

    await server.run(config.port_file, on_stop, grace_s=GRACE_S)


def api_keys(config: RouterConfig) -> ApiKeys | None:
    """The keys both public APIs require (``--api-key-file``; None: open)."""
    return ApiKeys(config.api_key_file) if config.api_key_file else None


async def start_http(
    config: RouterConfig,
    front: RequestFront,
    registry: NodeRegistry,
    keys: ApiKeys | None = None,
) -> HttpFront | None:
    """The OpenAI-compatible HTTP API on ``config.http_port`` (None: not served), on the same
    request path as the gRPC service: with ``keys`` requiring one of them, with
    ``config.http_tls_cert`` over HTTPS."""
    if config.http_port is None:
        if config.http_tls_cert:
            logger.warning("--http-tls-*: no --http-port, no HTTP API to serve over HTTPS")
        return None
    name = config.served_model_name or Path(config.model_path).name
    tls = None
    if config.http_tls_cert and config.http_tls_key:
        tls = https_context(config.http_tls_cert, config.http_tls_key)
    http = HttpFront(
        front,
        name,
        config.max_request_bytes,
        # A usable decode node serves every request, prefilling it itself when no prefill
        # node is configured or usable (the direct route, router.dispatch.choose_route).
        ready=lambda: bool(registry.decode.usable()),
        grace_s=GRACE_S,
        api_keys=keys,
        tls=tls,
    )
    port = await http.start(config.http_host or config.host, config.http_port, config.reuse_port)
    if config.http_port_file:
        write_port_file(config.http_port_file, port)
    return http


def serve(config: RouterConfig, model: ModelInfo | None = None) -> None:
    """Serve until SIGTERM/SIGINT (blocking). ``model``: as ``ModelInfo.load`` reads it from
    the config (which raises ``ValueError`` on a folder it cannot use)."""
    if model is None:
        model = ModelInfo.load(config.model_path, config.tokenizer_path)
    asyncio.run(_serve(config, model))
