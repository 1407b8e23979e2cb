"""Peer prefix fetches through the transfer layer: the asking prefill node reserves blocks for
the prefix, hands the holder a ticket in ``FetchBlocks``, and the holder copies its leading run
of those blocks straight into them over the paths of the layer's ``FETCH_PATHS`` (the node's
fetch receiver and fetch sender open only those) — no gRPC bytes, no Python copies.

    asker: reserve (blocks, then the layer) → FetchBlocks(hashes, its endpoint, ticket)
    holder: pin the run it holds → connect → send the first n blocks → FetchBlocksResponse(n)
    asker: finish(res, n) → register the n hashes → free the request (they stay cached)

Any failure frees what the asker reserved (after the grace the layer asks for, where the holder
may still be writing) and the caller falls back to gRPC bytes or computes.

The transfer sides are the engine's (``engine.api``: the receiver ``RX``, the fetch sender
``FETCH_TX``), reached through its commands by reservation id: they live where the engine lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterable
from typing import Any

import grpc

from splitserve.engine.api import FETCH_TX, RX, NodeEngine, Pinned, ResInfo
from splitserve.engine.local import FETCH_RECEIVER_MARK
from splitserve.engine.loop import settle
from splitserve.kvstore import BlockHash
from splitserve.prefill_node.channels import Channels
from splitserve.runtime import counter_names as names
from splitserve.runtime.auth import call_metadata
from splitserve.transfer import Endpoint, Ticket, choose_path
from splitserve.transfer import TransferError as TransferLayerError
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)

ROUTE_TTL_S = 60.0  # a peer's sender endpoint is looked up again after this long
MAX_FETCH_PEERS = 64  # receivers the fetch sender keeps paths to
CONNECT_WAIT_S = 2.0  # the holder waits this long for a path to be set up, then declines
SEND_TIMEOUT_S = 30.0  # the holder's copy into the asker's blocks


class LayerFetch:
    def __init__(self, engine: NodeEngine, channels: Channels, counters: Counter[str]) -> None:
        self.engine = engine
        self.block_size, self.block_nbytes = engine.info.block_size, engine.info.block_nbytes
        self.channels, self.counters = channels, counters
        kv = engine.kv
        # Asking: the engine's receiver (side RX: a prefill node opens it over the fetch paths
        # only), whose endpoint the holders connect to.
        self._rx_endpoint = Endpoint.from_bytes(kv.rx_endpoint) if kv.opened(RX) else None
        self._rx_paths = kv.rx_paths
        # Serving: the engine's fetch sender (side FETCH_TX); its id is what the askers' tickets
        # name (the node's address, as its endpoint says).
        serving = kv.opened(FETCH_TX) and bool(kv.fetch_endpoint)
        self._fetch_id = Endpoint.from_bytes(kv.fetch_endpoint).node_id if serving else ""
        self._fetch_paths = kv.fetch_paths
        self._routes: dict[str, tuple[tuple[str, str] | None, float]] = {}
        self._later: set[asyncio.Task] = set()
        self._fetch_peers: dict[str, None] = {}  # receivers served, least recently used first

    # ------------------------------------------------------------------ asking

    async def fetch(
        self, peer: str, root: bytes, want: list[BlockHash], proof: dict[str, Any], timeout: float
    ) -> int | None:
        """Fetch the leading run of ``want`` that ``peer`` holds into the prefix cache through
        the layer; how many blocks were adopted, or None: no layer path to that peer (fetch
        bytes instead)."""
        route = await self._route(peer)
        if route is None:
            return None
        path, sender_id = route
        endpoint = self.engine.kv.rx_endpoint  # a route needs a receiver
        rid = f"fetch-{uuid.uuid4().hex}"
        n = len(want)
        reserving: asyncio.Future[ResInfo] | None = None
        try:  # from before the reservation: a cancel landing while it is made still frees it
            reserved = await self.engine.reserve(rid, want, n * self.block_size)
            if reserved is None:
                return 0  # the pool is short: compute
            if reserved.missing != list(range(n)):
                return None  # some became cached meanwhile: the byte path copes with gaps
            # Made to its end, as the blocks' reservation: a cancel landing meanwhile still
            # hears its id, and the release below cancels it.
            reserving = asyncio.ensure_future(
                self.engine.rx_reserve(RX, sender_id, reserved.dest, path)
            )
            res = await settle(reserving)
            stub = nodes_pb2_grpc.PrefillNodeServiceStub(self.channels.get(peer))
            request = nodes_pb2.FetchBlocksRequest(
                block_hashes=want,
                model_root_hash=root,
                block_nbytes=self.block_nbytes,
                receiver_endpoint=endpoint,
                ticket=res.ticket,
                **proof,
            )
            call = stub.FetchBlocks(request, timeout=timeout, metadata=call_metadata())
            sent = await self._sent(call, n)
            if sent is None:
                self._routes.pop(peer, None)  # declined: look the peer up afresh next time
                return None
            # NOTE: the holder has sent when it answers: FETCH_PATHS has no path whose receiver
            # must take part (``receive_first``) meanwhile.
            await self.engine.rx_finish(RX, res.res_id, sent)  # it filled the first ``sent``
            if sent:
                await self.engine.register(rid, want[:sent])
            self.counters[names.prefix_fetches_via(path)] += 1
            return sent
        except (grpc.aio.AioRpcError, TransferLayerError, ValueError) as exc:
            self.counters[names.PREFIX_FETCH_FAILED] += 1
            logger.warning("prefix fetch from %s over %s failed: %s", peer, path, exc)
            return 0
        finally:
            # The release runs to its end, however often this call is cancelled meanwhile.
            await settle(asyncio.ensure_future(self._release(rid, reserving)))

    async def _sent(self, call: AsyncIterable[nodes_pb2.FetchBlocksResponse], n: int) -> int | None:
        """The holder's answer: blocks sent (None: it declined the layer)."""
        sent = None
        async for msg in call:
            if msg.meta or msg.data or sent is not None:
                raise ValueError("the peer answered a layer fetch with something else")
            if not msg.transfer_path:
                return None
            if msg.blocks_sent > n:
                raise ValueError(f"the peer says it sent {msg.blocks_sent} of {n} blocks")
            sent = msg.blocks_sent
        return sent

    async def _release(self, rid: str, reserving: asyncio.Future[ResInfo] | None) -> None:
        res = _made(reserving)
        if res is not None:
            # Idempotent; also drops what the path keeps for an ended reservation. A holder
            # writing into this pool itself may still have a copy on its way: then a grace.
            grace_s = await self.engine.rx_cancel(RX, res.res_id)
            if grace_s > 0:
                self._free_later(rid, grace_s)
                return
        await self.engine.free(rid)

    def _free_later(self, rid: str, grace_s: float) -> None:
        self.counters[names.IPC_BLOCKS_QUARANTINED] += 1

        async def free() -> None:
            await asyncio.sleep(grace_s)
            # engine.protocol.EngineGone (at shutdown): its blocks went with it.
            with contextlib.suppress(ConnectionError):
                await self.engine.free(rid)

        task = asyncio.create_task(free())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def path_to(self, peer: str) -> str | None:
        """The layer path fetches from ``peer`` take; None: gRPC bytes."""
        route = await self._route(peer)
        return route[0] if route is not None else None

    async def _route(self, peer: str) -> tuple[str, str] | None:
        """(path, the holder's sender id) for fetches from ``peer``, cached ROUTE_TTL_S."""
        if self._rx_endpoint is None:
            return None
        cached = self._routes.get(peer)
        if cached is not None and time.monotonic() - cached[1] < ROUTE_TTL_S:
            return cached[0]
        route = None
        try:
            stats = await nodes_pb2_grpc.NodeStatsServiceStub(self.channels.get(peer)).GetStats(
                nodes_pb2.GetStatsRequest(), timeout=5.0, metadata=call_metadata()
            )
            if stats.role == "prefill" and stats.transfer_endpoint:
                theirs = Endpoint.from_bytes(stats.transfer_endpoint)
                paths = self._rx_paths  # the fetch paths this node takes in
                path = choose_path(theirs, self._rx_endpoint, paths)
                route = (path, theirs.node_id) if path in paths else None
        except (grpc.aio.AioRpcError, ValueError) as exc:
            logger.info("prefix fetch path to %s: %s", peer, exc)
        self._routes[peer] = (route, time.monotonic())
        return route

    # ------------------------------------------------------------------ holding

    async def serve(
        self, request: nodes_pb2.FetchBlocksRequest, pinned: Pinned
    ) -> nodes_pb2.FetchBlocksResponse:
        """Send the ``pinned`` blocks (the leading run of the asked hashes held here) into the
        asker's reservation; the answer says how many (``transfer_path`` empty: declined).

        The asker's endpoint and ticket are input: the fetch sender is not the shipper's (a
        forged endpoint cannot take over a decode node's path), may use the fetch paths only,
        serves only receivers that are prefill nodes' fetch receivers, and writes only into the
        reservation of the receiver it just connected to."""
        declined = nodes_pb2.FetchBlocksResponse()
        n = len(pinned.block_ids)
        if not self._fetch_id or n == 0:
            return declined if not self._fetch_id else self._served(0, "")
        try:
            ticket = Ticket.from_bytes(request.ticket)
            peer = Endpoint.from_bytes(request.receiver_endpoint)
        except ValueError:
            return declined
        if (
            ticket.sender_id != self._fetch_id
            or ticket.receiver_id != peer.node_id
            or FETCH_RECEIVER_MARK not in peer.node_id
            or ticket.path not in self._fetch_paths
            or len(ticket.block_ids) != len(request.block_hashes)
        ):
            return declined
        try:
            connecting = self._connect(peer)
            path = await asyncio.wait_for(asyncio.shield(connecting), CONNECT_WAIT_S)
        except (TimeoutError, ValueError, TransferLayerError) as exc:
            logger.info("prefix fetch by a peer: no layer path (%s)", exc)
            return declined
        if path != ticket.path:
            return declined
        mine = dataclasses.replace(ticket, block_ids=ticket.block_ids[:n])
        try:
            # To its end even if the call is cancelled: an ipc copy is never left running into
            # blocks the asker may free.
            await self.engine.tx_send(FETCH_TX, mine.to_bytes(), pinned.block_ids, SEND_TIMEOUT_S)
        except (TransferLayerError, ValueError) as exc:
            logger.info("prefix fetch by %s over %s failed: %s", peer.node_id, path, exc)
            return declined  # the asker frees its reservation and fetches bytes or computes
        self.counters[names.BLOCKS_SERVED_TO_PEERS] += n
        self.counters[names.blocks_served_to_peers_via(path)] += n
        return self._served(n, path)

    async def _connect(self, peer: Endpoint) -> str:
        """Connect the fetch sender to ``peer``; at most MAX_FETCH_PEERS are kept (the least
        recently used is dropped: a restarted peer's old receiver id is never served again)."""
        path = await self.engine.tx_connect(FETCH_TX, peer.to_bytes())
        self._fetch_peers.pop(peer.node_id, None)
        self._fetch_peers[peer.node_id] = None
        while len(self._fetch_peers) > MAX_FETCH_PEERS:
            oldest = next(iter(self._fetch_peers))
            del self._fetch_peers[oldest]
            await self.engine.tx_close(FETCH_TX, oldest)
        return path

    @staticmethod
    def _served(n: int, path: str) -> nodes_pb2.FetchBlocksResponse:
        return nodes_pb2.FetchBlocksResponse(blocks_sent=n, transfer_path=path or "none")


def _made(reserving: asyncio.Future[ResInfo] | None) -> ResInfo | None:
    """The reservation ``reserving`` made, if it made one."""
    if reserving is None or not reserving.done() or reserving.cancelled():
        return None
    return None if reserving.exception() is not None else reserving.result()
