"""Prefill node process: load the model, serve PrefillNode (+ health, reflection, metrics) until
SIGTERM, then drain."""

from __future__ import annotations

import asyncio

from prefill_node.service import PrefillService
from proto import nodes_pb2, nodes_pb2_grpc
from splitserve.config import NodeConfig
from splitserve.serving import serve_node

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name


def serve(config: NodeConfig) -> None:
    asyncio.run(
        serve_node(
            config,
            "prefill",
            lambda engine, identity, cfg: PrefillService(engine, identity, cfg.transfer_deadline_s),
            nodes_pb2_grpc.add_PrefillNodeServicer_to_server,
            SERVICE_NAME,
        )
    )
