"""The decode stage of a request: the request's slot on its decode node D (``DecodeSession``),
its call on D's ``Relay`` stream (a decode command, or on the direct route a generate command),
and freeing D's blocks when the request is abandoned.

D failing mid-request: the client gets ``UNAVAILABLE`` (``RequestFront`` resumes the request on
another node where it can) and D is marked down. A client cancel or disconnect sends a cancel
command; the node frees the request's blocks. A request that ends at its first token starts no
decode: D's ``Release`` frees the KV shipped there.

Whichever route a request took, its first stage hands on a ``FirstToken``; ``Tried`` is the nodes
its attempts tried so far.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import grpc

from splitserve.router.kv_budget import KVDemand
from splitserve.router.pool import DecodeNode, DecodePool, Node
from splitserve.router.registry import NodeRegistry
from splitserve.router.relay import RelayCall, RelayChannel
from splitserve.router.request import GenerateError, GenerateParams
from splitserve.runtime.auth import call_metadata
from splitserve.runtime.failure import UNREACHABLE, Failure
from splitserve.runtime.protocol import LEASE_WHOLE, sampling_to_proto
from splitserve.v1 import nodes_pb2

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0  # D's Release call; past it D frees the blocks at its transfer deadline
LEASE_TELL_S = 0.005  # a node hears of this router's load changing at most this often
LEASE_SLACK = 1 / 16  # of a node's whole, wanted beyond what this router uses while none waits
LEASE_REOPEN_S = 0.2  # a leasing node's stream is opened again this soon after it ended


class FirstToken(NamedTuple):
    """A request's first output token: from P's Prefill answer (disaggregated) or from the first
    message of D's Generate stream (direct)."""

    token_id: int
    logprob: float
    finish_reason: str  # set: the node that sampled it ended the request there
    cached_tokens: int  # prompt tokens found in the computing node's cache
    computed_tokens: int = 0  # prompt tokens a prefill node computed for it (0: direct route)
    # As the prefill node reported them (0, "": direct): its engine's time to the first token,
    # the time the KV transfer added after it, and the path the blocks took.
    compute_s: float = 0.0
    transfer_s: float = 0.0
    transfer_path: str = ""
    blocks_shipped: int = 0  # as P reported them: blocks sent with data, and their bytes
    bytes_shipped: int = 0


class Tried(NamedTuple):
    """The nodes a request already tried: those that failed and those that only refused."""

    unreachable: set[Node]
    busy: set[Node]


class DecodeStage:
    """Claims slots on decode nodes, opens their streams, owns the background tasks that free
    what an abandoned request left on a node."""

    def __init__(
        self, registry: NodeRegistry, on_first_decode: Callable[[float], None] | None = None
    ) -> None:
        self._registry = registry
        # Seconds from a decode command's start to its first tokens (the stage histogram's).
        self.on_first_decode = on_first_decode
        self._background: set[asyncio.Task[None]] = set()
        self._channels: dict[DecodeNode, RelayChannel] = {}  # each decode node's Relay stream
        # Leases (decode_node.leases): a node that grants them gets this router's want and use
        # on its stream, at most every LEASE_TELL_S while the load moves; the streams of such
        # nodes are kept open from the health checker's round (no share without one).
        self._tell_pending: asyncio.TimerHandle | None = None
        registry.decode.on_load = self._load_changed
        registry.on_checked = self.keep_lease_streams

    def _channel(self, node: DecodeNode) -> RelayChannel:
        """``node``'s Relay stream (``router.relay``), opened if it has none or it broke."""
        channel = self._channels.get(node)
        if channel is None or channel.broken:
            channel = self._channels[node] = RelayChannel(
                node,
                self._registry.decode_stub(node),
                partial(self.error, node),
                self.on_first_decode,
                self._channel_ended,
                lease_of=self.lease_of,
                on_grant=self._registry.decode.notify_waiters,
            )
        return channel

    def _channel_ended(self, channel: RelayChannel) -> None:
        node = channel.node
        if self._channels.get(node) is channel:
            del self._channels[node]
        if node.lease is not None:
            # Without a stream it has no share for this router: open the next one soon (the
            # health checker's round would, within a second).
            asyncio.get_running_loop().call_later(LEASE_REOPEN_S, self.keep_lease_streams)

    # ------------------------------------------------------------------ leases

    def keep_lease_streams(self) -> None:
        """Open a Relay stream to every usable node that grants leases and has none."""
        if self._registry.closed:
            return
        for node in self._registry.decode.usable():
            if node.lease is not None:
                # A new stream asks as it opens (telling the same lease again sends nothing);
                # one opened by a request before the node was verified asks now.
                self._channel(node).tell_lease()

    def lease_of(self, node: DecodeNode) -> tuple[int, int] | None:
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

    def claim(
        self, node: DecodeNode, demand: KVDemand | None, node_request_id: str
    ) -> DecodeSession:
        """Count a request in flight on ``node`` (a slot and ``demand``'s KV ledger charge) until
        the session's ``close``: the one place a decode node's count is taken."""
        pool = self._registry.decode
        pool.acquire(node, demand=demand)
        return DecodeSession(self, pool, node, demand, node_request_id)

    def open(self, node: DecodeNode, node_request_id: str, deadline: float) -> RelayCall:
        """Start decoding a transferred request on D at once (so that it overlaps with relaying
        the first token), on D's Relay stream; read it with ``read``, and always ``close`` it."""
        command = nodes_pb2.RelayCommand(decode=nodes_pb2.DecodeRequest(request_id=node_request_id))
        return self._channel(node).start(command, node_request_id, deadline, first_alone=False)

    def open_direct(
        self, node: DecodeNode, request: nodes_pb2.GenerateOnNodeRequest, deadline: float
    ) -> RelayCall:
        """The direct route: the whole request on D (prefill and decode there), on D's Relay
        stream; read it with ``read`` (the first read is the first token alone), and always
        ``close`` it."""
        command = nodes_pb2.RelayCommand(generate=request)
        return self._channel(node).start(command, request.request_id, deadline, first_alone=True)

    def release(self, node: DecodeNode, node_request_id: str) -> None:
        """Free a transferred request's KV on D that no decode command will claim, without
        waiting for D's transfer deadline: D's ``Release``, in the background (the client has its
        answer)."""
        task = asyncio.create_task(self._release(node, node_request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, node: DecodeNode, node_request_id: str) -> None:
        stub = self._registry.decode_stub(node)
        try:
            await stub.Release(
                nodes_pb2.ReleaseRequest(request_id=node_request_id),
                timeout=RELEASE_TIMEOUT_S,
                metadata=call_metadata(),
            )
        except grpc.aio.AioRpcError as exc:  # D frees them at its transfer deadline
            why = f"{exc.code().name} {exc.details()}"
            logger.info(
                "decode node %s: release of %s failed: %s", node.address, node_request_id, why
            )
        except Exception as exc:  # e.g. the channel of a node that left was closed
            logger.info(
                "decode node %s: release of %s failed: %r", node.address, node_request_id, exc
            )

    def error(
        self, node: DecodeNode, code: Failure, details: str, deadline: float
    ) -> GenerateError:
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
        if code == Failure.UNIMPLEMENTED:  # a node of an older version: no Relay stream
            self._registry.decode.mark_down(node, f"{code.value}: {details}")
            return GenerateError(
                Failure.UNAVAILABLE,
                f"decode node {node.address} serves no Relay stream (an older version: run the "
                "same version on the router and every node); retry the request",
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
    ``DecodeStage.claim``, grown by ``grow``, given back once by ``close``) and its one call on
    D's Relay stream: the direct route's generate (``open_generate``) or the decode ``stream``
    starts.
    """

    __slots__ = ("_call", "_closed", "_pool", "_stage", "demand", "node", "request_id")

    def __init__(
        self,
        stage: DecodeStage,
        pool: DecodePool,
        node: DecodeNode,
        demand: KVDemand | None,
        request_id: str,
    ) -> None:
        self._stage = stage
        self._pool = pool
        self.node = node
        self.demand = demand
        self.request_id = request_id  # the request's id on its nodes
        self._call: RelayCall | None = None
        self._closed = False

    def open_generate(self, request: nodes_pb2.GenerateOnNodeRequest, deadline: float) -> RelayCall:
        """The direct route: D prefills and decodes the request itself (``request``)."""
        assert self._call is None and not self._closed, "the session's stream is already open"
        self._call = self._stage.open_direct(self.node, request, deadline)
        return self._call

    def stream(self, deadline: float) -> RelayCall:
        """D's tokens for the request: the direct route's call if open, else a new decode."""
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


class DirectStage:
    """One direct attempt: D's Generate up to its first token.

    The direct route's stage (``router.dispatch.choose_route``): D's Generate prefills the
    prompt on D itself, no prefill node, no KV transfer; the stage ends at D's first token, the
    stream stays open in the request's ``DecodeSession`` for the decode stage to relay."""

    async def attempt(
        self, params: GenerateParams, session: DecodeSession, tried: Tried, deadline: float
    ) -> FirstToken | GenerateError:
        """The first token; the error when another attempt may succeed (raised when none can).
        The stream stays in ``session`` either way: its owner closes it."""
        d = session.node
        request = nodes_pb2.GenerateOnNodeRequest(
            request_id=session.request_id,
            prompt_token_ids=params.prompt_token_ids,
            sampling=sampling_to_proto(params.sampling),
            cache_salt=params.cache_salt,
        )
        # D's busy rate while it prefills our prompts (tokens per busy second): what its tiers'
        # loads are priced against (router.prefix.CachedPrefix), as a prefill node's are.
        d.rate.start()
        computed = 0
        try:
            reply = await session.open_generate(request, deadline).read()  # marks D down when
            if len(reply.token_ids) != 1:  # it is unreachable
                raise GenerateError(
                    Failure.INTERNAL,
                    f"decode node {d.address} sent {len(reply.token_ids)} first tokens",
                )
            computed = max(len(params.prompt_token_ids) - reply.cached_tokens, 0)
        except GenerateError as exc:
            if exc.code == Failure.REFUSED:
                tried.busy.add(d)
                return exc
            if exc.code == Failure.UNAVAILABLE and time.monotonic() < deadline:
                tried.unreachable.add(d)
                return exc
            raise
        finally:
            d.rate.end(computed)
        return FirstToken(
            token_id=reply.token_ids[0],
            logprob=reply.logprobs[0] if reply.logprobs else 0.0,
            finish_reason=reply.finish_reason,
            cached_tokens=reply.cached_tokens,
        )
