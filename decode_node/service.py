"""DecodeNodeService servicer: turns TransferKV, Relay, Release and GetStats messages into calls.

Receiving KV (any path) is ``receiver.KVInbox`` / ``Transfer``; requests waiting for their
decode command are ``pending.PendingTable``. Tokens leave only on a router's ``Relay`` stream
(``relay_stream.RelayStream``): its decode command joins an adopted request to the
continuous-batching engine (or the request is freed at its deadline), its generate command (the
router's direct route) serves a whole request, prefilled in this node's own engine, then decoded
there. ``start_decode``/``join_decode``, ``start_generate``/``join_generate`` and ``end`` are what
the stream calls.

Over 300 lines: the decode service's four RPCs, each a thin translation; they share one request
table and drain state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from splitserve.decode_node.header import Refused, TransferRefused
from splitserve.decode_node.leases import LeaseBook
from splitserve.decode_node.peer_caps import PeerCaps, PeerLimits
from splitserve.decode_node.pending import DRAIN_HOLD_S, Pending, PendingTable
from splitserve.decode_node.receiver import BAD, KVInbox, Transfer
from splitserve.decode_node.relay_stream import RelayStream
from splitserve.engine.api import EngineFigures, NodeEngine, OutputSink
from splitserve.kvstore import ModelIdentity
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime import counter_names as names
from splitserve.runtime import tracing
from splitserve.runtime.failure import Failure
from splitserve.runtime.metrics import LoadFigures
from splitserve.runtime.node import checked_request, node_stats
from splitserve.runtime.status import to_grpc
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)


# Through the transfer layer TransferEnd may take this many transfer deadlines (the blocks move
# first).
LAYER_IDLE_FACTOR = 4
MAX_RELEASE_ID_CHARS = 1024  # Release's request_id (input from another node: bounded)
# The engine's own counters a decode node exports besides its own and preemptions (named where
# they are produced: ``AsyncEngine.counters``), and those of its prefix cache and KV tiers
# (``KVPort.prefix_stats``: a decode node prefills on the direct route).
ENGINE_COUNTERS = ("steps", "step_seconds", "engine_job_seconds")
ENGINE_COUNTER_PREFIXES = ("prefix_", "host_tier_", "disk_tier_", "store_tier_")


class DecodeService(nodes_pb2_grpc.DecodeNodeServiceServicer):
    def __init__(
        self,
        engine: NodeEngine,
        identity: ModelIdentity,
        deadline_s: float,
        peer_limits: PeerLimits | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.engine = engine
        self.stream_interval = stream_interval  # tokens per message to the router, at most
        self.identity = identity
        self.deadline_s = deadline_s
        self.pending = PendingTable()
        self.counters: Counter[str] = Counter()
        caps = None if peer_limits is None else PeerCaps(peer_limits, self.counters)
        self.inbox = KVInbox(engine, identity, self.pending, self.counters, caps)
        # Set on SIGTERM: new transfers and generate commands are refused, accepted ones finish.
        self.draining = False
        self._transfers = 0  # TransferKV calls in flight
        # Requests in flight on the relay streams and Release calls: counted from their start, so
        # a drain cannot end in the moment a request has taken its pending entry but not yet
        # reached the engine.
        self.calls = 0
        self.relay_streams: set[RelayStream] = set()  # one per router connected
        # The relay streams' requests, each a task (``relay_stream``) that may outlive its stream.
        self.relay_tasks: set[asyncio.Task[None]] = set()
        self.leases = LeaseBook()  # the routers' shares of this node (decode_node.leases)
        self._joining: dict[str, Pending] = {}  # taken by start_decode, not yet in the engine

    # ------------------------------------------------------------------ life cycle

    def background(self) -> list:
        return [self.pending.expire_forever(self.inbox.free, self._count_expired)]

    def _count_expired(self) -> None:
        self.counters[names.TRANSFERS_EXPIRED] += 1

    async def drain(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until every accepted request is done: transfers in flight,
        transferred requests waiting for their decode command, and requests decoding (those this
        node added to the engine and has not ended: ``KVInbox.live``)."""
        deadline = time.monotonic() + timeout_s
        self.pending.hold_at_most(min(DRAIN_HOLD_S, timeout_s))
        live = self.inbox.live
        while self._transfers or self.calls or self.pending or live:
            if time.monotonic() >= deadline:
                logger.warning(
                    "drain: %d transfers, %d pending, %d calls, %d in the engine after %.0f s",
                    self._transfers,
                    len(self.pending),
                    self.calls,
                    len(live),
                    timeout_s,
                )
                return
            await self.inbox.freed.wait(0.1)

    async def close(self) -> None:
        await self.inbox.close()

    def load(self, figures: EngineFigures | None = None) -> LoadFigures:
        """The node's load (``figures``: the engine's, default its latest known: no wait)."""
        figures = self.engine.last_figures() if figures is None else figures
        return LoadFigures.of_figures(figures, pending_transfers=len(self.pending))

    def all_counters(self, figures: EngineFigures | None = None) -> dict[str, float]:
        """This node's counters and the engine's (steps, step and job seconds, preemptions)."""
        engine = (self.engine.last_figures() if figures is None else figures).counters
        return {
            **self.counters,
            names.PREEMPTIONS: engine.get("preemptions", 0),
            **{
                name: value
                for name, value in engine.items()
                if name in ENGINE_COUNTERS or name.startswith(ENGINE_COUNTER_PREFIXES)
            },
        }

    async def GetStats(
        self, request: nodes_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.GetStatsResponse:
        figures = await self.engine.figures()
        stats = node_stats(
            "decode",
            self.engine.info,
            figures,
            self.load(figures),
            self.all_counters(figures),
            transfer_endpoint=self.engine.kv.rx_endpoint,
        )
        stats.relay_leases = True
        return stats

    # ------------------------------------------------------------------ transfer

    async def TransferKV(
        self,
        request_iterator: AsyncIterator[nodes_pb2.TransferKVRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[nodes_pb2.TransferKVResponse]:
        if self.draining:
            # NOTE: the header is read before refusing: a bidirectional call ended while the
            # client is still writing can reach the client as INTERNAL "Internal error from
            # Core" instead of this status, and only UNAVAILABLE is retried elsewhere.
            await anext(request_iterator, None)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "decode node is draining; ship to another node"
            )
        self._transfers += 1
        transfer: Transfer | None = None
        trace = tracing.carrier_of(context.invocation_metadata())
        traced = tracing.start("decode_node.TransferKV", carrier=trace, server=True)
        failure: str | None = "cancelled"
        try:
            first = await anext(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise TransferRefused(BAD, "a transfer starts with a TransferHeader")
            transfer = self.inbox.begin(first.header, _peer_of(first.header, context))
            await transfer.reserve(context.time_remaining())
            yield nodes_pb2.TransferKVResponse(missing=transfer.missing, ticket=transfer.ticket)
            end = await self._receive(transfer, request_iterator, context)
            token = self._first_token(first.header, end)
            await transfer.commit()
            self._adopted(transfer, token)
            reused = len(transfer.hashes) - len(transfer.missing)
            if traced.span.is_recording():
                traced.span.set_attributes(_transfer_attributes(transfer))
            failure = None
            yield nodes_pb2.TransferKVResponse(done=True, blocks_reused=reused)
        except TransferRefused as exc:
            failure = f"{exc.code.value}: {exc}"
            self.counters[names.TRANSFERS_FAILED] += 1
            if transfer is not None:
                await transfer.release()
            await context.abort(to_grpc(exc.code), str(exc))
        except ConnectionError as exc:  # the engine is gone: the sender ships to another node
            failure = f"the engine is gone: {exc}"
            self.counters[names.TRANSFERS_FAILED] += 1
            await _engine_gone(context, exc)
        except BaseException:
            # Client gone or cancelled: nothing half-written is ever registered; free the rest.
            self.counters[names.TRANSFERS_FAILED] += 1
            raise
        finally:
            try:
                if transfer is not None:
                    await transfer.release()  # idempotent; an adopted transfer's blocks stay
            finally:
                self._transfers -= 1
                self.inbox.freed.notify()
                traced.end(failure)

    async def _receive(
        self,
        transfer: Transfer,
        request_iterator: AsyncIterator[nodes_pb2.TransferKVRequest],
        context: grpc.aio.ServicerContext,
    ) -> nodes_pb2.TransferEnd:
        """The sender's messages after our reply: BlockData until TransferEnd when the blocks
        come on the stream (gRPC bytes); through the layer only TransferEnd, once the sender has
        moved the blocks (where the layer receives them itself, after they are in the pool;
        ``commit`` has the layer check that they all arrived). Returns the TransferEnd."""
        if not transfer.on_stream:
            await transfer.receive(context.time_remaining() or self.deadline_s)
            # The sender moves the blocks first (seconds even for GBs): a generous bound.
            end = await self._next(request_iterator, LAYER_IDLE_FACTOR * self.deadline_s)
            if end is None or end.WhichOneof("kind") != "end":
                path = transfer.path
                raise TransferRefused(BAD, f"expected TransferEnd after the {path} transfer")
            return end.end
        while (msg := await self._next(request_iterator, self.deadline_s)) is not None:
            kind = msg.WhichOneof("kind")
            if kind == "end":
                return msg.end
            if kind != "blocks":
                raise TransferRefused(BAD, f"unexpected {kind} message in a transfer")
            await transfer.write(msg.blocks.meta, msg.blocks.data)
        raise TransferRefused(BAD, "transfer ended without a TransferEnd")

    async def _next(
        self, messages: AsyncIterator[nodes_pb2.TransferKVRequest], idle_s: float
    ) -> nodes_pb2.TransferKVRequest | None:
        """The sender's next message (None: it closed); a sender silent for ``idle_s`` loses its
        reservation: blocks are not held for a stream that stopped sending."""
        try:
            return await asyncio.wait_for(anext(messages, None), idle_s)
        except TimeoutError:
            raise TransferRefused(
                Failure.DEADLINE,
                f"the sender sent nothing for {idle_s:.0f} s: transfer given up",
            ) from None

    def _first_token(
        self, header: nodes_pb2.TransferHeader, end: nodes_pb2.TransferEnd
    ) -> int | None:
        """The first token TransferEnd brings, checked (None: the header had it)."""
        if not header.first_token_at_end:
            return None
        vocab = self.engine.info.vocab_size
        if end.first_token_id >= vocab:
            raise TransferRefused(BAD, f"first_token_id {end.first_token_id} >= vocab {vocab}")
        return end.first_token_id

    def _adopted(self, transfer: Transfer, first_token: int | None) -> None:
        """The transfer's blocks are registered: the request waits for its decode command.
        ``first_token``: the one TransferEnd brought (None: the header's)."""
        header = transfer.header
        self.pending.add(
            transfer.rid,
            Pending(
                transfer.prompt,
                header.first_token_id if first_token is None else first_token,
                transfer.params,
                header.cache_salt or None,
                # Never held past this node's own --transfer-deadline-s, whatever the sender asks.
                time.monotonic() + min(header.deadline_s or self.deadline_s, self.deadline_s),
            ),
        )
        if not transfer.on_stream:
            self.counters[names.transfers_via(transfer.path)] += 1
        self.counters[names.TRANSFERS] += 1
        self.counters[names.BLOCKS_ADOPTED] += len(transfer.missing)
        self.counters[names.BLOCKS_REUSED] += len(transfer.hashes) - len(transfer.missing)
        self.counters[names.BYTES_RECEIVED] += transfer.nbytes

    # ------------------------------------------------------------------ decode

    def start_decode(self, rid: str, sink: OutputSink) -> None:
        """Take a transferred request out of the pending table and subscribe ``sink`` to its
        outputs; ``join_decode`` then adds it to the engine. From here it is the caller's: end it
        with ``end`` whatever follows. ``Refused`` (NOT_FOUND) when no KV was transferred."""
        pending = self.pending.pop(rid)
        if pending is None:
            raise Refused(
                Failure.NOT_FOUND,
                f"request {rid!r} has no transferred KV here (never sent, or its deadline passed)",
            )
        # No await since the pop: the id goes from the pending table to the live set at once.
        self.engine.subscribe_sink(rid, sink)
        self.inbox.live.add(rid)
        self._joining[rid] = pending

    async def join_decode(self, rid: str) -> None:
        """Join the request ``start_decode`` took to the engine; ``Refused`` when it cannot."""
        pending = self._joining.pop(rid)
        try:
            await self.engine.add_transferred(
                rid, pending.prompt, pending.first_token, pending.params, pending.cache_salt
            )
        except ValueError as exc:  # the id is taken (a repeated decode of one request)
            raise Refused(Failure.ALREADY_EXISTS, str(exc)) from None
        except ConnectionError as exc:
            raise Refused(Failure.UNAVAILABLE, f"the decode node's engine is gone: {exc}") from None

    # ------------------------------------------------------------------ release

    async def Release(
        self, request: nodes_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.ReleaseResponse:
        """Free a transferred request's blocks that no decode command will claim (the router's
        client had its answer with the first token); idempotent. Authenticated like every
        internal call (``runtime.auth``); the id is checked before it is looked up."""
        rid = request.request_id
        if not rid or len(rid) > MAX_RELEASE_ID_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id must have 1 to {MAX_RELEASE_ID_CHARS} characters, got {len(rid)}",
            )
        if self.pending.release(rid) is None:  # not adopted (yet), decoding, released, expired
            return nodes_pb2.ReleaseResponse(released=False)
        self.calls += 1  # a drain waits until the blocks are freed
        try:
            self.counters[names.TRANSFERS_RELEASED] += 1
            await self.inbox.free(rid)  # to the end, even if this call is cancelled
        finally:
            self.calls -= 1
            self.inbox.freed.notify()
        return nodes_pb2.ReleaseResponse(released=True)

    # ------------------------------------------------------------------ generate (direct route)

    def start_generate(
        self, request: nodes_pb2.GenerateOnNodeRequest, sink: OutputSink
    ) -> tuple[list[int], SamplingParams]:
        """Check a whole request and subscribe ``sink`` to its outputs: its prompt and sampling
        parameters, for ``join_generate``. From here it is the caller's: end it with ``end``
        whatever follows. ``Refused`` saying why when it cannot start."""
        if self.draining:
            raise Refused(Failure.UNAVAILABLE, "decode node is draining; retry on another node")
        rid = request.request_id
        try:
            params, prompt = checked_request(self.engine.info, request)
        except ValueError as exc:
            raise Refused(Failure.INVALID, str(exc)) from None
        if self.inbox.in_use(rid):
            # Another call's (decoding, transferred, in transfer): touch nothing of it.
            raise Refused(Failure.ALREADY_EXISTS, f"request {rid!r} is already on this node")
        self.engine.subscribe_sink(rid, sink)
        self.inbox.live.add(rid)
        return prompt, params

    async def join_generate(
        self, request: nodes_pb2.GenerateOnNodeRequest, prompt: list[int], params: SamplingParams
    ) -> None:
        """Add the request ``start_generate`` took to the engine; ``Refused`` when it cannot."""
        try:
            await self.engine.add_request(
                request.request_id, prompt, params, request.cache_salt or None
            )
        except ValueError as exc:  # the id is taken
            raise Refused(Failure.ALREADY_EXISTS, str(exc)) from None
        except ConnectionError as exc:
            raise Refused(Failure.UNAVAILABLE, f"the decode node's engine is gone: {exc}") from None
        self.counters[names.DIRECT_REQUESTS] += 1

    def count_direct(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A direct request's first token: its prompt and the part of it found cached."""
        self.counters[names.DIRECT_PROMPT_TOKENS] += prompt_tokens
        self.counters[names.DIRECT_CACHED_TOKENS] += cached_tokens

    # ------------------------------------------------------------------ relay (one per router)

    async def Relay(
        self,
        request_iterator: AsyncIterator[nodes_pb2.RelayCommand],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[nodes_pb2.RelayBatch]:
        """Every request of one router on this node, on one stream (``relay_stream``)."""
        await context.send_initial_metadata(())  # the router sends requests once it hears this
        async for batch in RelayStream(self).run(request_iterator):
            yield batch

    async def end(self, rid: str, finished: bool) -> None:
        """A request's end (its relay stream's task): cancelled (mid-prefill too), failed, or
        never joined (add_* refused, or dropped from the engine's queue by the cancel), the
        request is ended and every block held under its id freed, to the end; then it leaves
        the live set."""
        self.engine.unsubscribe(rid)
        self._joining.pop(rid, None)
        try:
            if not finished and await self.engine.end_request(rid):
                self.counters[names.REQUESTS_ABORTED] += 1
        except ConnectionError as exc:  # the engine is gone, the request and its blocks with it
            logger.warning("request %s not ended: %s", rid, exc)
        finally:
            self.inbox.live.discard(rid)
            self.inbox.freed.notify()


def _transfer_attributes(transfer: Transfer) -> dict[str, str | int | bool]:
    return {
        "splitserve.request_id": transfer.rid,
        "splitserve.transfer_path": transfer.path or "grpc",
        "splitserve.blocks_received": len(transfer.missing),
        "splitserve.blocks_skipped": len(transfer.hashes) - len(transfer.missing),
        "splitserve.bytes": transfer.nbytes,
        "splitserve.streamed": transfer.streamed,
    }


async def _engine_gone(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End a call whose engine is gone (``ConnectionError``: an engine process that died; the
    node exits) with UNAVAILABLE, the status callers retry on another node."""
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"the decode node's engine is gone: {exc}")
    raise AssertionError("unreachable: abort raises")


def _peer_of(header: nodes_pb2.TransferHeader, context: grpc.aio.ServicerContext) -> str:
    """Whom a transfer counts against (``peer_caps``): its sender's id, else the connection's
    host (``ipv4:10.0.0.7:51234`` → ``ipv4:10.0.0.7``: one host's channels share one cap)."""
    if header.sender_id:
        return header.sender_id
    return context.peer().rpartition(":")[0] or context.peer()
