"""KVShipper: ships a prefilled prompt's KV into a decode node — only the blocks it lacks.

One ``TransferKV`` stream per request: the header (tokens, block hashes, model identity), the
decode node's answer (the hashes it lacks, and a ticket when a transfer-layer path was agreed),
then either the blocks through the transfer layer (the engine's sender, side ``TX``, over whichever
path it set up) or as ``BlockData`` bytes (``transfer.grpc_bytes.codec``, ~4 MB messages), then
``TransferEnd`` and the decode node's confirmation. The engine is reached through its
``engine.api.NodeEngine`` commands only (it may live in another process): the request's blocks
are named by the ids its first output brought (``FirstFacts``).

Over 300 lines: one transfer's sending protocol (header, agreed path or bytes, end, confirmation,
and how each step fails) is kept in one file so it reads in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

import grpc

from splitserve.engine.api import TX, NodeEngine
from splitserve.kvstore import BlockHash, hash_request_tokens
from splitserve.prefill_node.channels import Channels
from splitserve.runtime import counter_names as names
from splitserve.runtime.auth import call_metadata
from splitserve.runtime.failure import UNREACHABLE, Failure
from splitserve.runtime.status import from_grpc
from splitserve.transfer import Endpoint, StreamFailed, batch_indices, encode_blocks
from splitserve.transfer import TransferError as TransferLayerError
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)

ENDPOINT_TTL_S = 60.0  # how long a decode node's transfer endpoint is trusted without a look-up
CONNECT_WAIT_S = 2.0  # a request waits this long for a transfer path to be set up
# What grpc's asyncio client reports when a write fails because the server already ended the
# call (e.g. a decode node that refused the transfer or stopped): the server's own status is
# lost. Answered as UNAVAILABLE, so the router retries on another pair.
TRANSPORT_BROKE = "Internal error from Core"
GRPC_BYTES = "grpc"  # how the figures name the byte stream (the services' own, no layer path)


class ShipError(Exception):
    """A failed shipment: why (the Prefill call answers with its status) and what happened."""

    def __init__(self, code: Failure, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Shipped(NamedTuple):
    blocks_shipped: int
    blocks_reused: int  # full blocks the decode node already held
    bytes_shipped: int
    path: str  # the path the blocks took (``grpc``: the byte stream)


class _Stream:
    """The request side of one TransferKV call, fed from an outbox."""

    def __init__(
        self,
        stub: nodes_pb2_grpc.DecodeNodeServiceStub,
        header: nodes_pb2.TransferHeader,
        timeout: float | None,
    ) -> None:
        self.outbox: asyncio.Queue[nodes_pb2.TransferKVRequest | None] = asyncio.Queue()
        self.outbox.put_nowait(nodes_pb2.TransferKVRequest(header=header))
        self.call = stub.TransferKV(self._messages(), timeout=timeout, metadata=call_metadata())

    async def _messages(self) -> AsyncIterator[nodes_pb2.TransferKVRequest]:
        while (msg := await self.outbox.get()) is not None:
            yield msg

    def send(self, msg: nodes_pb2.TransferKVRequest | None) -> None:
        """Queue ``msg`` (None: end the request stream)."""
        self.outbox.put_nowait(msg)

    async def read(self, error: Failure, what: str) -> nodes_pb2.TransferKVResponse:
        reply = await self.call.read()
        if reply is grpc.aio.EOF:  # pyright: ignore[reportAttributeAccessIssue] (not in the stubs)
            raise ShipError(error, what)
        return reply

    def abandon(self) -> None:
        self.outbox.put_nowait(None)  # end the request stream before cancelling the call
        self.call.cancel()


class OpenStream(NamedTuple):
    """A shipment opened before its prefill (``KVShipper.open_stream``)."""

    stream: _Stream
    address: str
    path: str
    num_hashes: int
    missing: int
    t0: float


class KVShipper:
    def __init__(
        self,
        engine: NodeEngine,
        root_hash: bytes,
        deadline_s: float,
        channels: Channels,
        counters: Counter[str],
        stream_min_tokens: int = 0,
    ) -> None:
        self.engine = engine
        # Prompts of at least this many tokens ship layer by layer while they are computed,
        # where the path to their decode node can (0: never).
        self.stream_min_tokens = stream_min_tokens
        self.root = root_hash
        self.block_size, self.block_nbytes = engine.info.block_size, engine.info.block_nbytes
        self.deadline_s = deadline_s
        self.channels, self.counters = channels, counters
        # The KV transfer layer's sender (the engine's side TX, where it opened one): its paths
        # to decode nodes that offer them; "": gRPC bytes only.
        self.sender_id = engine.kv.tx_id if engine.kv.opened(TX) else ""
        # decode address → (transfer path or "", its receiver id, when resolved)
        self._routes: dict[str, tuple[str, str, float]] = {}

    async def close(self) -> None:
        """Nothing to close: the sender is the engine's (it closes its transfer sides itself)."""

    async def ship(
        self,
        request: nodes_pb2.PrefillRequest,
        prompt: list[int],
        block_hashes: Sequence[bytes],
        block_ids: list[int],
        first_token: int,
        timeout: float | None,
    ) -> Shipped:
        """Ship the prompt's KV (``request``: its PrefillRequest; ``block_hashes``: its full
        blocks' hashes, ``block_ids``: every block it holds, the partial tail last, as its first
        output's ``FirstFacts`` gave them) into the decode node; ``ShipError`` says why not."""
        address = request.decode_address
        hashes = list(map(BlockHash, block_hashes[: len(prompt) // self.block_size]))
        path, receiver_id = await self._transfer_path(address)
        header = self._header(request, prompt, first_token, hashes, path, receiver_id)
        path = path or GRPC_BYTES
        stream = _Stream(
            nodes_pb2_grpc.DecodeNodeServiceStub(self.channels.get(address)), header, timeout
        )
        t0 = time.perf_counter()
        try:
            missing, nbytes, path = await self._exchange(
                stream, address, block_ids, hashes, len(prompt), path, timeout
            )
        except (grpc.aio.AioRpcError, ShipError) as exc:
            stream.abandon()
            raise self._failed(address, exc) from None
        except BaseException:
            stream.abandon()
            raise
        return self._shipped(len(hashes), missing, nbytes, t0, path)

    def _shipped(self, num_hashes: int, missing: int, nbytes: int, t0: float, path: str) -> Shipped:
        reused = num_hashes - missing
        self.counters[names.BLOCKS_SHIPPED] += missing
        self.counters[names.BLOCKS_REUSED_ON_DECODE] += reused
        self.counters[names.BYTES_SHIPPED] += nbytes
        self.counters[names.TRANSFER_SECONDS] += time.perf_counter() - t0  # pyright: ignore[reportArgumentType] (seconds: a float)
        return Shipped(missing, reused, nbytes, path)

    def _failed(self, address: str, exc: grpc.aio.AioRpcError | ShipError) -> ShipError:
        """The ShipError a failed transfer's call answers with."""
        self.counters[names.TRANSFERS_FAILED] += 1
        if isinstance(exc, ShipError):
            code, details = exc.code, exc.message
        else:
            code, details = from_grpc(exc.code()), exc.details() or ""
        if code == Failure.INTERNAL and details == TRANSPORT_BROKE:
            code = Failure.UNAVAILABLE  # the stream broke, not the transfer
        # CANCELLED: the decode node's server stopped the call (shutting down); the stream
        # is ours, so a cancel of our own would have raised asyncio.CancelledError instead.
        if code in UNREACHABLE:
            return ShipError(code, f"decode node {address} unreachable: {details}")
        return ShipError(code, f"decode node {address}: {details}")

    # ------------------------------------------------------------------ layer-wise streams

    def may_stream(self, prompt_len: int) -> bool:
        """Whether a prompt this long may ship while it is computed (``open_stream``)."""
        return (
            0 < self.stream_min_tokens <= prompt_len
            and bool(self.sender_id)
            and bool(self.engine.kv.tx_layered)
        )

    async def open_stream(
        self, request: nodes_pb2.PrefillRequest, prompt: list[int], timeout: float | None
    ) -> OpenStream | None:
        """Before the request is added to the engine: the decode node's reservation and the
        engine's stream of its blocks into it (``NodeEngine.tx_stream_open``), so the blocks
        leave layer by layer as the prefill writes them; ``finish_stream`` ends it. None: the
        pair's path cannot stream, or the decode node declined it (the request ships after its
        prefill, ``ship``); ``ShipError``: the decode node cannot take it (nothing computed)."""
        address = request.decode_address
        path, receiver_id = await self._transfer_path(address)
        if path not in self.engine.kv.tx_layered:
            return None
        salt = request.cache_salt or None
        chain = await asyncio.to_thread(
            hash_request_tokens, prompt, self.block_size, self.root, salt
        )
        hashes = list(map(BlockHash, chain))
        header = self._header(request, prompt, 0, hashes, path, receiver_id)
        header.first_token_at_end = True
        stream = _Stream(
            nodes_pb2_grpc.DecodeNodeServiceStub(self.channels.get(address)), header, timeout
        )
        t0 = time.perf_counter()
        try:
            reply = await stream.read(Failure.UNAVAILABLE, "decode node closed the transfer")
            if not reply.ticket:  # declined (it restarted?): bytes after the prefill instead
                stream.abandon()
                self._routes.pop(address, None)
                return None
            missing = list(reply.missing)
            tail = [len(hashes)] if len(prompt) % self.block_size else []
            await self.engine.tx_stream_open(
                TX, reply.ticket, request.request_id, missing + tail, timeout or self.deadline_s
            )
        except (grpc.aio.AioRpcError, ShipError) as exc:
            stream.abandon()
            raise self._failed(address, exc) from None
        except (TransferLayerError, ValueError) as exc:
            stream.abandon()
            self.counters[names.TRANSFERS_FAILED] += 1
            raise ShipError(Failure.UNAVAILABLE, f"{path} stream failed: {exc}") from None
        except BaseException:
            stream.abandon()
            raise
        return OpenStream(stream, address, path, len(hashes), len(missing), t0)

    async def finish_stream(
        self,
        opened: OpenStream,
        request_id: str,
        first: asyncio.Future[tuple[int, list[int]] | None],
    ) -> Shipped | None:
        """The end of an ``open_stream`` shipment: the blocks are all in (``tx_stream_wait``),
        then the first token in TransferEnd and the decode node's confirmation. ``first``: set
        by the caller to (first token, the request's block ids) at its first output, to None
        when the request ended there (the reservation is let go: returns None), cancelled when
        the prefill failed."""
        stream, address, path = opened.stream, opened.address, opened.path
        try:
            try:
                nbytes = await self.engine.tx_stream_wait(TX, request_id)
            except (TransferLayerError, ValueError) as exc:
                if not isinstance(exc, StreamFailed):  # (the request's fault, not the path's)
                    self._routes.pop(address, None)
                raise ShipError(Failure.UNAVAILABLE, f"{path} stream failed: {exc}") from None
            self.counters[names.transfers_via(path)] += 1
            got = await first
            if got is None:  # it ended at its first token: nothing to decode
                stream.abandon()
                return None
            await self._conclude(stream, got[0])
        except (grpc.aio.AioRpcError, ShipError) as exc:
            stream.abandon()
            raise self._failed(address, exc) from None
        except BaseException:
            stream.abandon()
            raise
        self.counters[names.TRANSFERS_STREAMED] += 1
        return self._shipped(opened.num_hashes, opened.missing, nbytes, opened.t0, path)

    def _header(
        self,
        request: nodes_pb2.PrefillRequest,
        prompt: list[int],
        first_token: int,
        hashes: list[BlockHash],
        path: str,
        receiver_id: str,
    ) -> nodes_pb2.TransferHeader:
        return nodes_pb2.TransferHeader(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            first_token_id=first_token,
            block_hashes=hashes,
            model_root_hash=self.root,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            block_nbytes=self.block_nbytes,
            deadline_s=self.deadline_s,
            sender_id=self.sender_id,
            transfer_path=path,
            receiver_id=receiver_id,
        )

    async def _exchange(
        self,
        stream: _Stream,
        address: str,
        ids: list[int],
        hashes: list[BlockHash],
        num_tokens: int,
        path: str,
        timeout: float | None,
    ) -> tuple[int, int, str]:
        """The stream after the header; returns (full blocks shipped, bytes shipped, the path
        they took)."""
        reply = await stream.read(Failure.UNAVAILABLE, "decode node closed the transfer")
        missing = list(reply.missing)
        # The partial tail block (if any) follows the full ones in the request's blocks.
        tail = [ids[len(hashes)]] if num_tokens % self.block_size else []
        if reply.ticket:
            src = [ids[i] for i in missing] + tail
            nbytes = await self._send_through_layer(address, path, reply.ticket, src, timeout)
        else:
            if path:  # the decode node declined (it restarted?): look it up afresh next time
                self._routes.pop(address, None)
            nbytes = await self._send_bytes(stream, missing, ids, tail)
            path = GRPC_BYTES
        await self._conclude(stream, None)
        return len(missing), nbytes, path

    async def _conclude(self, stream: _Stream, first_token: int | None) -> None:
        """TransferEnd (with the first token when the header said it comes there), then the
        decode node's confirmation."""
        end = nodes_pb2.TransferEnd(first_token_id=first_token or 0)
        stream.send(nodes_pb2.TransferKVRequest(end=end))
        stream.send(None)
        reply = await stream.read(Failure.INTERNAL, "decode node did not confirm the transfer")
        if not reply.done:
            raise ShipError(Failure.INTERNAL, "decode node did not confirm the transfer")

    async def _send_bytes(
        self, stream: _Stream, missing: list[int], ids: list[int], tail: list[int]
    ) -> int:
        """The ``missing`` full blocks (indices into the block hashes; ``ids``: the request's
        blocks) as BlockData messages in runs, then the tail block."""
        runs = [(run, False) for run in batch_indices(missing, self.block_nbytes)]
        if tail:
            runs.append(([-1], True))
        nbytes = 0
        for run, is_tail in runs:
            src = tail if is_tail else [ids[i] for i in run]
            data = await self.engine.read(src)
            meta, data = await asyncio.to_thread(encode_blocks, run, data, is_tail)
            nbytes += len(data)
            stream.send(
                nodes_pb2.TransferKVRequest(blocks=nodes_pb2.BlockData(meta=meta, data=data))
            )
        return nbytes

    # ------------------------------------------------------------------ transfer layer

    async def _send_through_layer(
        self, address: str, path: str, ticket: bytes, src: list[int], timeout: float | None
    ) -> int:
        """Move the blocks with the transfer layer. The copy is never left running behind a
        closed stream (ipc writes straight into the decode node's blocks): ``tx_send`` runs to
        its end however often the request is cancelled meanwhile."""
        try:
            nbytes = await self.engine.tx_send(TX, ticket, src, timeout or self.deadline_s)
        except (TransferLayerError, ValueError) as exc:
            self._routes.pop(address, None)
            raise ShipError(Failure.UNAVAILABLE, f"{path} transfer failed: {exc}") from None
        self.counters[names.transfers_via(path)] += 1
        return nbytes

    async def _transfer_path(self, decode_address: str) -> tuple[str, str]:
        """(path, receiver id) to ``decode_address`` through the transfer layer: ("", "") for
        the gRPC byte stream. Resolved once and kept ENDPOINT_TTL_S (a node restarted at the
        same address may offer more), so shipping itself only looks it up."""
        if not self.sender_id:
            return "", ""
        cached = self._routes.get(decode_address)
        if cached is not None and time.monotonic() - cached[2] < ENDPOINT_TTL_S:
            return cached[0], cached[1]
        route = await self._resolve_route(decode_address)
        if route is None:
            return "", ""
        self._routes[decode_address] = (*route, time.monotonic())
        return route

    async def _resolve_route(self, decode_address: str) -> tuple[str, str] | None:
        """Look up the decode node's transfer endpoint and set up the path to it; ``None``: not
        settled yet (no answer, or the path still being set up): ship bytes, try next time."""
        try:
            stats = await nodes_pb2_grpc.NodeStatsServiceStub(
                self.channels.get(decode_address)
            ).GetStats(nodes_pb2.GetStatsRequest(), timeout=5.0, metadata=call_metadata())
        except grpc.aio.AioRpcError:
            return None
        if not stats.transfer_endpoint:
            return "", ""
        try:
            # Setting up a pair can take long (dist: a rendezvous); the request does not wait
            # for it past CONNECT_WAIT_S: it ships as gRPC bytes, the setup completes meanwhile.
            path = await asyncio.wait_for(
                asyncio.shield(self.engine.tx_connect(TX, stats.transfer_endpoint)),
                CONNECT_WAIT_S,
            )
        except TimeoutError:
            return None
        except Exception as exc:
            logger.warning("kv transfer to %s: %s; sending gRPC bytes", decode_address, exc)
            return "", ""
        if path not in self.engine.kv.tx_paths:  # the byte path: BlockData on the stream
            return "", ""
        return path, Endpoint.from_bytes(stats.transfer_endpoint).node_id
