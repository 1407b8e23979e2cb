"""Prefill node process: load the model, serve PrefillNodeService (+ NodeStatsService, health,
reflection, metrics) until SIGTERM, then drain."""

from __future__ import annotations

import asyncio

from splitserve.prefill_node.service import PrefillService
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import serve_node, transfer_paths
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["PrefillNodeService"].full_name


def make_service(engine, identity, config: NodeConfig, address: str) -> PrefillService:
    from splitserve.transfer import KVSender

    paths = transfer_paths(config)
    sender = None
    if len(paths) > 1:
        sender = KVSender(engine.kv_port.kv_pool, address, paths=paths)
    return PrefillService(engine, identity, config.transfer_deadline_s, sender=sender)


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
