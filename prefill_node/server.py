"""Prefill node process: load the model, serve PrefillNodeService (+ NodeStatsService, health,
reflection, metrics) until SIGTERM, then drain."""

from __future__ import annotations

import asyncio
import uuid

from splitserve.engine.loop import AsyncEngine
from splitserve.kvstore import ModelIdentity
from splitserve.prefill_node.peer_layer import FETCH_RECEIVER_MARK
from splitserve.prefill_node.service import PrefillService
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import kv_security, serve_node, transfer_paths
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["PrefillNodeService"].full_name


def make_service(
    engine: AsyncEngine, identity: ModelIdentity, config: NodeConfig, address: str
) -> PrefillService:
    from splitserve.transfer import fetch_paths, open_receiver, open_sender

    paths = transfer_paths(config)
    security = kv_security(config)  # TLS on tcp, dist between nodes, the rendezvous key
    pool = engine.kv_port.kv_pool
    sender = receiver = fetch_sender = None
    if len(paths) > 1:  # a path besides gRPC bytes
        sender = open_sender(pool, address, paths=paths, security=security)
    fetch = fetch_paths(paths)
    if fetch:
        # Serving peers' fetches: its own sender, over the fetch paths only (the asker names the
        # receiver). Peers' prefix blocks come in through the receiver, over the same paths
        # (listening on the advertised host); a new id per process life, as the decode node's.
        fetch_sender = open_sender(pool, address, paths=fetch, security=security)
        receiver = open_receiver(
            pool,
            f"{address}{FETCH_RECEIVER_MARK}{uuid.uuid4().hex[:8]}",
            paths=fetch,
            host=config.advertised_host(),
            security=security,
        )
    return PrefillService(
        engine,
        identity,
        config.transfer_deadline_s,
        sender=sender,
        receiver=receiver,
        fetch_sender=fetch_sender,
    )


def serve(config: NodeConfig) -> None:
    asyncio.run(
        serve_node(
            config,
            "prefill",
            make_service,
            nodes_pb2_grpc.add_PrefillNodeServiceServicer_to_server,
            SERVICE_NAME,
        )
    )
