"""The decode stage of a request: the request's slot on its decode node D (``DecodeSession``),
D's token stream (its Decode call, or on the direct route its Generate call), and freeing D's
blocks when the request is abandoned.

The Decode stream failing mid-request cannot be retried (tokens were already sent): the client
gets ``UNAVAILABLE`` and D is marked down. A client cancel or disconnect cancels the stream; the
node frees the request's blocks. A request that ends at its first token never opens Decode: D's
``Release`` frees the KV shipped there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import grpc

from splitserve.router.errors import UNREACHABLE, Failure, GenerateError
from splitserve.router.kv_budget import KVDemand
from splitserve.router.pool import Node, NodePool
from splitserve.router.registry import NodeRegistry
from splitserve.router.relay import RelayCall, RelayChannel
from splitserve.router.status import from_grpc
from splitserve.runtime.auth import call_metadata
from splitserve.runtime.protocol import LEASE_WHOLE
from splitserve.v1 import nodes_pb2

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0  # how long an abandoned Decode call waits for the node's first answer
RELEASE_TIMEOUT_S = 5.0  # D's Release call; past it D frees the blocks at its transfer deadline
# D's Release answering these: a node of an older version (no Release), or one refusing the id;
# its blocks are freed the old way, by a Decode call cancelled once it has started.
RELEASE_FALLBACK = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT)
LEASE_TELL_S = 0.005  # a node hears of this router's load changing at most this often
LEASE_SLACK = 1 / 16  # of a node's whole, wanted beyond what this router uses while none waits
LEASE_REOPEN_S = 0.2  # a leasing node's stream is opened again this soon after it ended


class DecodeStage:
    """Claims slots on decode nodes, opens their streams, owns the background tasks that free
    what an abandoned request left on a node."""

    def __init__(
        self, registry: NodeRegistry, on_first_decode: Callable[[float], None] | None = None
    ) -> None:
        self._registry = registry
        # Seconds from a Decode call's start to its first tokens (the stage histogram's).
        self.on_first_decode = on_first_decode
        self._background: set[asyncio.Task[None]] = set()
        self._channels: dict[Node, RelayChannel] = {}  # each decode node's Relay stream
        self._no_relay: set[Node] = set()  # nodes that answered Relay with UNIMPLEMENTED
        # Leases (decode_node.leases): a node that grants them gets this router's want and use
        # on its stream, at most every LEASE_TELL_S while the load moves; the streams of such
        # nodes are kept open from the health checker's round (no share without one).
        self._tell_pending: asyncio.TimerHandle | None = None
        registry.decode.on_load = self._load_changed
        registry.on_checked = self.keep_lease_streams

    def _channel(self, node: Node) -> RelayChannel | None:
        """``node``'s Relay stream if it is ready; None (a call of its own for this request)
        while it opens, and where the node serves none."""
        if node in self._no_relay:
            return None
        channel = self._channels.get(node)
        if channel is None or channel.broken:
            self._open_channel(node)
            return None
        return channel if channel.ready else None

    def _open_channel(self, node: Node) -> None:
        self._channels[node] = RelayChannel(
            node,
            self._registry.decode_stub(node),
            partial(self.error, node),
            self.on_first_decode,
            self._channel_ended,
            lease_of=self.lease_of,
            on_grant=self._registry.decode.notify_waiters,
        )

    def _channel_ended(self, channel: RelayChannel) -> None:
        node = channel.node
        if self._channels.get(node) is channel:
            del self._channels[node]
        if channel.unimplemented:
            self._no_relay.add(node)
            if node.lease is not None:  # it grants no leases after all: the static share
                node.lease = None
                node.apply_share()
                self._registry.decode.notify_waiters()
        elif node.lease is not None:
            # Without a stream it has no share for this router: open the next one soon (the
            # health checker's round would, within a second).
            asyncio.get_running_loop().call_later(LEASE_REOPEN_S, self.keep_lease_streams)

    # ------------------------------------------------------------------ leases

    def keep_lease_streams(self) -> None:
        """Open a Relay stream to every usable node that grants leases and has none."""
        if self._registry.closed:
            return
        for node in self._registry.decode.usable():
            if node.lease is None or node in self._no_relay:
                continue
            channel = self._channels.get(node)
            if channel is None or channel.broken:
                self._open_channel(node)
            else:  # e.g. opened by a request before the node was verified: it asks now
                channel.tell_lease()

    def lease_of(self, node: Node) -> tuple[int, int] | None:
        """(want, used) of ``node`` for this router, in parts per million (None: the node is
        not known to grant leases): it uses its requests' share; it wants all it may fill while
        requests wait for room, else what it uses and LEASE_SLACK more."""
        if node.lease is None:
            return None
        used = node.used_share()
        want = node.share if self._registry.decode.waiting else min(node.share, used + LEASE_SLACK)
        return round(want * LEASE_WHOLE), math.ceil(used * LEASE_WHOLE)

    def _load_changed(self) -> None:
        if self._tell_pending is None and self._channels:
            loop = asyncio.get_running_loop()
            self._tell_pending = loop.call_later(LEASE_TELL_S, self._tell_leases)

    def _tell_leases(self) -> None:
        self._tell_pending = None
        for channel in self._channels.values():
            channel.tell_lease()

    def claim(self, node: Node, demand: KVDemand | None, node_request_id: str) -> DecodeSession:
        """Count a request in flight on ``node`` (a slot and ``demand``'s KV ledger charge) until
        the session's ``close``: the one place a decode node's count is taken."""
        pool = self._registry.decode
        pool.acquire(node, demand=demand)
        return DecodeSession(self, pool, node, demand, node_request_id)

    def open(self, node: Node, node_request_id: str, deadline: float) -> DecodeCall | RelayCall:
        """Start decoding a transferred request on D at once (so that it overlaps with relaying
        the first token), on D's Relay stream; read it with ``read``, and always ``close`` it."""
        channel = self._channel(node)
        if channel is None:
            return self._open_decode(node, node_request_id, deadline)
        command = nodes_pb2.RelayCommand(decode=nodes_pb2.DecodeRequest(request_id=node_request_id))
        return channel.start(command, node_request_id, deadline, first_alone=False)

    def _open_decode(self, node: Node, node_request_id: str, deadline: float) -> DecodeCall:
        """D's Decode call for one request (a node without Relay)."""
        stub = self._registry.decode_stub(node)
        call = stub.Decode(
            nodes_pb2.DecodeRequest(request_id=node_request_id),
            timeout=max(deadline - time.monotonic(), 0.001),
            metadata=call_metadata(),
        )
        return DecodeCall(self, node, call, deadline, timed=True)

    def open_direct(
        self, node: Node, request: nodes_pb2.GenerateOnNodeRequest, deadline: float
    ) -> DecodeCall | RelayCall:
        """The direct route: the whole request on D (prefill and decode there), on D's Relay
        stream; read it with ``read`` (the first read is the first token alone), and always
        ``close`` it."""
        channel = self._channel(node)
        if channel is None:
            return self._open_generate(node, request, deadline)
        command = nodes_pb2.RelayCommand(generate=request)
        return channel.start(command, request.request_id, deadline, first_alone=True)

    def _open_generate(
        self, node: Node, request: nodes_pb2.GenerateOnNodeRequest, deadline: float
    ) -> DecodeCall:
        """D's Generate call for one request (a node without Relay)."""
        call = self._registry.decode_stub(node).Generate(
            request, timeout=max(deadline - time.monotonic(), 0.001), metadata=call_metadata()
        )
        # D sends its initial metadata once the request is in its engine, long before the first
        # token of a long prompt: from then on a cancel reaches the handler.
        return DecodeCall(
            self, node, call, deadline, asyncio.ensure_future(call.initial_metadata())
        )

    def release(self, node: Node, node_request_id: str) -> None:
        """Free a transferred request's KV on D that no Decode call will claim, without waiting
        for D's transfer deadline: D's ``Release``, in the background (the client has its
        answer)."""
        self._in_background(self._release(node, node_request_id))

    async def _release(self, node: Node, node_request_id: str) -> None:
        stub = self._registry.decode_stub(node)
        try:
            await stub.Release(
                nodes_pb2.ReleaseRequest(request_id=node_request_id),
                timeout=RELEASE_TIMEOUT_S,
                metadata=call_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in RELEASE_FALLBACK:
                self._cancel_decode(node, node_request_id)
            else:  # unreachable: D frees them at its transfer deadline
                logger.info(
                    "decode node %s: release of %s failed: %s",
                    node.address,
                    node_request_id,
                    exc.code().name,
                )
        except Exception as exc:  # e.g. the channel of a node that left was closed
            logger.info(
                "decode node %s: release of %s failed: %r", node.address, node_request_id, exc
            )

    def _cancel_decode(self, node: Node, node_request_id: str) -> None:
        """Free the request the old way: start its Decode and cancel it once D answers."""
        stub = self._registry.decode_stub(node)
        call = stub.Decode(
            nodes_pb2.DecodeRequest(request_id=node_request_id),
            metadata=call_metadata(),
        )
        self.cancel_once_started(call, asyncio.ensure_future(call.read()))

    def cancel_once_started(
        self, call: grpc.aio.UnaryStreamCall, first_read: asyncio.Future
    ) -> None:
        """Cancel ``call`` in the background once the node has answered (so its handler runs
        and sees the cancel), or after CANCEL_WAIT_S at the latest."""

        async def cancel() -> None:
            try:
                await asyncio.wait_for(first_read, CANCEL_WAIT_S)
            except (Exception, asyncio.CancelledError):
                pass  # timed out, failed or ended: cancel in any case
            finally:
                call.cancel()

        self._in_background(cancel())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def error(self, node: Node, code: Failure, details: str, deadline: float) -> GenerateError:
        """What the client hears of a request's stream on D failing with ``code`` (D is marked
        down if unreachable)."""
        if code == Failure.DEADLINE and time.monotonic() >= deadline:
            return GenerateError(code, "the request's deadline passed while decoding")
        if code in UNREACHABLE:
            self._registry.decode.mark_down(node, f"{code.value}: {details}")
            return GenerateError(
                Failure.UNAVAILABLE,
                f"decode node {node.address} failed mid-request ({details}); retry the request",
            )
        if code == Failure.NOT_FOUND:
            return GenerateError(
                Failure.INTERNAL,
                f"decode node {node.address} no longer holds the request's KV ({details})",
            )
        return GenerateError(code, f"decode node {node.address}: {details}")


class DecodeSession:
    """One request on its decode node D, from the moment D is chosen to the request's end.

    It owns the request's slot there (D's in-flight count and its KV ledger charge: taken by
    ``DecodeStage.claim``, grown by ``grow``, given back once by ``close``) and its one stream on
    D: the direct route's Generate (``open_generate``) or the Decode call ``stream`` opens.
    """

    __slots__ = ("_call", "_closed", "_pool", "_stage", "demand", "node", "request_id")

    def __init__(
        self,
        stage: DecodeStage,
        pool: NodePool,
        node: Node,
        demand: KVDemand | None,
        request_id: str,
    ) -> None:
        self._stage = stage
        self._pool = pool
        self.node = node
        self.demand = demand
        self.request_id = request_id  # the request's id on its nodes
        self._call: DecodeCall | RelayCall | None = None
        self._closed = False

    def open_generate(
        self, request: nodes_pb2.GenerateOnNodeRequest, deadline: float
    ) -> DecodeCall | RelayCall:
        """The direct route: D prefills and decodes the request itself (``request``)."""
        assert self._call is None and not self._closed, "the session's stream is already open"
        self._call = self._stage.open_direct(self.node, request, deadline)
        return self._call

    def stream(self, deadline: float) -> DecodeCall | RelayCall:
        """D's token stream: the Generate call if open (direct), else a new Decode call."""
        if self._call is None:
            assert not self._closed, "the session is closed"
            self._call = self._stage.open(self.node, self.request_id, deadline)
        return self._call

    def grow(self, output_tokens: int) -> None:
        """The request has ``output_tokens`` of output: charge the blocks it now fills beyond
        its reserve (``KVLedger.grow``)."""
        if self.demand is not None:
            self.node.kv.grow(self.demand, output_tokens)

    def close(self, release_kv: bool = False) -> None:
        """End the request on D (idempotent): close its stream and give its slot back.
        ``release_kv``: no stream was opened and D holds KV shipped for it (the request ended at
        its first token, which P's answer did not finish): D's ``Release`` frees it."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._call is not None:
                self._call.close()
            elif release_kv:
                self._stage.release(self.node, self.request_id)
        finally:  # the slot and the ledger charge go back whatever closing the stream raised
            self._pool.release(self.node, demand=self.demand)


class DecodeCall:
    """One request's Decode (or, direct, Generate) stream on D.

    NOTE: a cancel that reaches D before its Decode handler has started is dropped by gRPC, and
    D would hold the blocks until its transfer deadline. Until D has answered once, the read is
    shielded from our own cancellation, and an abandoned call is cancelled only once D has
    answered (see ``DecodeStage.cancel_once_started``): its first message, or ``started`` (the
    direct route: Generate's initial metadata, sent once the request is in D's engine).
    """

    def __init__(
        self,
        stage: DecodeStage,
        node: Node,
        call: grpc.aio.UnaryStreamCall,
        deadline: float,
        started: asyncio.Future | None = None,
        timed: bool = False,
    ) -> None:
        self._stage = stage
        self._opened = time.monotonic() if timed else None  # a Decode call: its first is timed
        self._node = node
        self._call = call
        self._deadline = deadline
        self._first_read: asyncio.Future | None = asyncio.ensure_future(call.read())
        self._started = started
        if started is not None:
            started.add_done_callback(lambda t: t.cancelled() or t.exception())
        # One wait on D's stall signal for the whole stream: if D stops answering health checks
        # (frozen, its host gone), the call is cancelled at once, so a read in progress or the
        # next one ends with UNAVAILABLE rather than a wait until the request's deadline.
        # NOTE: reads are plain awaits of the call; racing each one against the signal took a
        # task and an asyncio.wait per token batch (~6% of the router's CPU;
        # docs/benchmarks-history.md, "The router's CPU per relayed token, CPU (2026-12-01)").
        self._stalled = False
        self._stall = asyncio.ensure_future(node.stall_signal().wait())
        self._stall.add_done_callback(self._on_stall)

    def _on_stall(self, signal: asyncio.Future) -> None:
        if signal.cancelled():
            return  # closed
        self._stalled = True
        self._first_read = None  # given up: nothing to wait for before cancelling
        self._call.cancel()

    async def read(self) -> nodes_pb2.DecodeResponse:
        """D's next batch of tokens; raises ``GenerateError`` when the stream fails or ends
        before the request finished."""
        try:
            first = self._first_read
            if first is not None:
                first.add_done_callback(lambda t: t.cancelled() or t.exception())
                reply = await asyncio.shield(first)
                self._first_read = None
                on_first = self._stage.on_first_decode
                if self._opened is not None and on_first is not None:
                    on_first(time.monotonic() - self._opened)
            else:
                reply = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._stage.error(
                self._node, from_grpc(exc.code()), exc.details() or "", self._deadline
            ) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stalled and not (task is not None and task.cancelling()):
                raise GenerateError(  # the call was cancelled by _on_stall, not our caller
                    Failure.UNAVAILABLE,
                    f"decode node {self._node.address} stopped answering health checks "
                    "mid-request; retry the request",
                ) from None
            raise
        if reply is grpc.aio.EOF:  # pyright: ignore[reportAttributeAccessIssue] (not in the stubs)
            raise GenerateError(
                Failure.INTERNAL,
                f"decode node {self._node.address} ended the stream without finishing",
            )
        return reply  # pyright: ignore[reportReturnType] (the stubs type EOF as object)

    def close(self) -> None:
        self._stall.cancel()
        if self._first_read is None:
            self._call.cancel()  # no-op when the call has finished
        else:
            answered = self._started if self._started is not None else self._first_read
            self._stage.cancel_once_started(self._call, answered)
