"""Prefill node process: load the model, serve PrefillNodeService (+ NodeStatsService, health,
reflection, metrics) until SIGTERM, then drain."""

from __future__ import annotations

import asyncio
import uuid

from splitserve.prefill_node.peer_layer import FETCH_RECEIVER_MARK
from splitserve.prefill_node.service import PrefillService
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import serve_node, transfer_paths
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["PrefillNodeService"].full_name


def make_service(engine, identity, config: NodeConfig, address: str) -> PrefillService:
    from splitserve.transfer import IPC, TCP, KVReceiver, KVSender

    paths = transfer_paths(config)
    pool = engine.kv_port.kv_pool
    sender = receiver = fetch_sender = None
    if len(paths) > 1:
        sender = KVSender(pool, address, paths=paths)
    if IPC in paths or TCP in paths:
        # Serving peers' fetches: its own sender, ipc/tcp only (the asker names the receiver).
        fetch_sender = KVSender(pool, address, paths=[p for p in paths if p in (IPC, TCP)])
        # Peers' prefix blocks come in through it (ipc/tcp; dist pairs are for decode nodes).
        # A new id per process life, as the decode node's.
        receiver = KVReceiver(
            pool,
            f"{address}{FETCH_RECEIVER_MARK}{uuid.uuid4().hex[:8]}",
            ipc=False if IPC not in paths else None,
            dist=False,
            tcp=TCP in paths,
            tcp_host=config.advertised_host() if TCP in paths else None,
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
