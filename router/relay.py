"""One ``Relay`` stream per decode node (``RelayChannel``): every request of this router on that
node is started, read and cancelled through it, its tokens arriving in one message per engine
step for all of them (``DecodeNodeService.Relay``).

The channel's one reader task takes each ``RelayBatch`` apart and puts every request's part into
that request's ``RelayCall``, waking its reader once; the request's handler drains everything
that arrived meanwhile in one ``read``. So the router pays a message per step and node, not per
token and request, and a client that reads slower than the node decodes gets fuller messages.

It is the one way tokens leave a decode node. A request started while the stream still opens
waits in it: commands go in order once the node answers. The stream failing, or failing to open
(the node gone, silent to health checks: ``Node.stall_signal``, or of an older version without
``Relay``), fails every request on it as the node's failure (``DecodeStage.error``: UNAVAILABLE,
and the request path resumes it elsewhere); the next request opens a new stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import grpc

from splitserve.router.pool import DecodeNode
from splitserve.router.request import GenerateError
from splitserve.runtime import tracing
from splitserve.runtime.auth import credentials
from splitserve.runtime.failure import Failure
from splitserve.runtime.protocol import LEASE_WHOLE
from splitserve.runtime.status import from_grpc
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

# What a failure of a request's stream on the node means for the client: (failure, the node's
# details, the request's deadline) -> the error (``DecodeStage.error``, which marks the node down
# when it is unreachable).
ErrorOf = Callable[[Failure, str, float], GenerateError]

logger = logging.getLogger(__name__)

LEASE_STEP = 5_000  # a change in want or use below this (0.5% of the node) is not sent


class Tokens(NamedTuple):
    """What one ``read`` hands over: every token that arrived since the last one."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # set on the request's last read
    cached_tokens: int  # a direct request's first read: prompt tokens found in D's cache


class RelayChannel:
    """The ``Relay`` stream to one decode node: ``start`` a request on it (while it still opens
    too), read its ``RelayCall``. Open until it fails (``broken``; the router's channel to the
    node closing ends it too), which fails every request on it."""

    def __init__(
        self,
        node: DecodeNode,
        stub: nodes_pb2_grpc.DecodeNodeServiceStub,
        error_of: ErrorOf,
        on_first_decode: Callable[[float], None] | None,
        on_end: Callable[[RelayChannel], None],
        lease_of: Callable[[DecodeNode], tuple[int, int] | None],
        on_grant: Callable[[], None],
    ) -> None:
        self.node = node
        self.error = error_of
        self._on_first_decode = on_first_decode  # seconds from a decode's start to its tokens
        self._on_end = on_end
        self._calls: dict[str, RelayCall] = {}
        self._commands: asyncio.Queue[nodes_pb2.RelayCommand | None] = asyncio.Queue()
        self.ready = False  # the node answered: the stream is open
        self.broken = False
        self._stalled = False
        self._call = stub.Relay(self._send(), metadata=credentials())
        self._reader = asyncio.create_task(self._read())
        self._answered = asyncio.ensure_future(self._call.initial_metadata())
        self._answered.add_done_callback(self._on_answer)
        self._stall = asyncio.ensure_future(node.stall_signal().wait())
        self._stall.add_done_callback(self._on_stall)
        # The node's share for this router (node.lease): what it wants and uses, (want, used)
        # in parts per million; None while the node is not known to grant leases.
        self._lease_of = lease_of
        self._on_grant = on_grant
        self._seen = 0  # the last grant applied
        self._told: tuple[int, int, int] | None = None  # the last lease sent, coarsely
        self.tell_lease()

    def _on_answer(self, answered: asyncio.Future) -> None:
        if not answered.cancelled() and answered.exception() is None and not self.broken:
            self.ready = True

    def start(
        self, command: nodes_pb2.RelayCommand, request_id: str, deadline: float, first_alone: bool
    ) -> RelayCall:
        """Send ``command`` (a decode or generate of ``request_id``); its tokens come to the
        returned call."""
        assert not self.broken, "start on a relay stream that ended"
        call = RelayCall(self, request_id, deadline, first_alone)
        self._calls[request_id] = call
        command.deadline_s = max(deadline - time.monotonic(), 0.001)
        if tracing.enabled():
            command.trace.update(dict(tracing.outgoing()))
        self._commands.put_nowait(command)
        return call

    def cancel(self, request_id: str) -> None:
        """End the request on the node (its blocks freed there); nothing more comes to it."""
        if self._calls.pop(request_id, None) is not None and not self.broken:
            self._commands.put_nowait(nodes_pb2.RelayCommand(cancel=request_id))

    def forget(self, request_id: str) -> None:
        """The request ended on the node: drop its entry."""
        self._calls.pop(request_id, None)

    def tell_lease(self, force: bool = False) -> None:
        """Send the node what share this router wants and uses (once it is known to grant
        leases), when that changed by more than LEASE_STEP since the last time (``force``:
        always; it acknowledges a grant)."""
        lease = self._lease_of(self.node)
        if lease is None or self.broken:
            return
        want, used = lease
        told = (want // LEASE_STEP, -(-used // LEASE_STEP), self._seen)
        if not force and told == self._told:
            return
        self._told = told
        lease = nodes_pb2.RelayLease(want_ppm=want, used_ppm=used, seen_grant=self._seen)
        self._commands.put_nowait(nodes_pb2.RelayCommand(lease=lease))

    def _granted(self, grant: nodes_pb2.RelayGrant) -> None:
        if grant.seq <= self._seen:
            return  # a grant older than one applied (never sent so, but input)
        self._seen = grant.seq
        node = self.node
        node.lease = min(grant.share_ppm, LEASE_WHOLE) / LEASE_WHOLE
        node.apply_share()
        self.tell_lease(force=True)
        self._on_grant()

    def first_decoded(self, seconds: float) -> None:
        if self._on_first_decode is not None:
            self._on_first_decode(seconds)

    async def _send(self) -> AsyncIterator[nodes_pb2.RelayCommand]:
        while (command := await self._commands.get()) is not None:
            yield command

    async def _read(self) -> None:
        error: GenerateError
        try:
            async for batch in self._call:
                calls = self._calls
                for out in batch.outputs:  # pyright: ignore[reportAttributeAccessIssue]
                    call = calls.get(out.request_id)
                    if call is not None:
                        call.feed(out)
                if batch.HasField("grant"):  # pyright: ignore[reportAttributeAccessIssue]
                    self._granted(batch.grant)  # pyright: ignore[reportAttributeAccessIssue]
            error = self.error(Failure.UNAVAILABLE, "it ended its relay stream", 0.0)
        except grpc.aio.AioRpcError as exc:
            error = self._ended_by(from_grpc(exc.code()), exc.details() or "")
        except asyncio.CancelledError:  # closed (grpc.aio raises this for a cancelled call)
            error = self._ended_by(None, "")
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                self._end(error)
                raise
        self._end(error)

    def _ended_by(self, code: Failure | None, details: str) -> GenerateError:
        """What the stream's requests fail with: ``code`` (None: the router closed it)."""
        if self._stalled:
            return GenerateError(
                Failure.UNAVAILABLE,
                f"decode node {self.node.address} stopped answering health checks mid-request; "
                "retry the request",
            )
        if code is None:
            return GenerateError(
                Failure.CANCELLED,
                f"the router closed its relay stream to decode node {self.node.address}",
            )
        return self.error(code, details, 0.0)

    def _end(self, error: GenerateError) -> None:
        """The stream is over: every request on it fails with ``error``."""
        self.broken = True
        self.ready = False
        self._stall.cancel()
        self._answered.cancel()
        self._commands.put_nowait(None)
        if self.node.lease is not None:
            # Its share ended with the stream (the node frees it for the others): nothing more
            # goes there until a new stream is granted one.
            self.node.lease = 0.0
            self.node.apply_share()
        self._on_end(self)
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.fail(error)

    def _on_stall(self, signal: asyncio.Future) -> None:
        if signal.cancelled():
            return
        self._stalled = True
        self._call.cancel()


class RelayCall:
    """One request's tokens on a ``RelayChannel``: ``read`` them, always ``close`` it."""

    __slots__ = (
        "_cached",
        "_channel",
        "_deadline",
        "_ended",
        "_error",
        "_finish",
        "_first_alone",
        "_logprobs",
        "_opened",
        "_timer",
        "_tokens",
        "_waiter",
        "request_id",
    )

    def __init__(
        self,
        channel: RelayChannel,
        request_id: str,
        deadline: float,
        first_alone: bool,
    ) -> None:
        self._channel = channel
        self.request_id = request_id
        self._deadline = deadline
        self._first_alone = first_alone  # the first read hands over the first token alone
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._cached = 0
        self._finish = ""
        self._error: GenerateError | None = None
        self._ended = False  # the node ended it (finished or failed): nothing to cancel there
        self._waiter: asyncio.Future[None] | None = None
        self._opened = time.monotonic()
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            deadline - time.monotonic(), self._expire
        )

    # ------------------------------------------------------------------ from the channel

    def feed(self, out: nodes_pb2.RelayOutput) -> None:
        """The request's part of one batch."""
        if out.token_ids:
            self._tokens.extend(out.token_ids)
            self._logprobs.extend(out.logprobs)
        if out.cached_tokens:
            self._cached = out.cached_tokens
        if out.finish_reason:
            self._finish = out.finish_reason
            self._ended = True
        elif out.error_code:
            self._ended = True
            code = _STATUS.get(out.error_code, Failure.UNKNOWN)
            self.fail(self._channel.error(code, out.error_message, self._deadline))
            return
        self._wake()

    def fail(self, error: GenerateError) -> None:
        if self._error is None and not self._finish:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self) -> None:
        self._timer = None
        self.fail(GenerateError(Failure.DEADLINE, "the request's deadline passed while decoding"))

    # ------------------------------------------------------------------ for the request

    async def read(self) -> Tokens:
        """Every token that arrived since the last read (at least one, or the end); raises
        ``GenerateError`` when the request failed on the node (after its tokens before)."""
        while not (self._tokens or self._finish or self._error):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._opened:
            if not self._first_alone:  # a transferred request's first decode step
                self._channel.first_decoded(time.monotonic() - self._opened)
            self._opened = 0.0
        if self._tokens:
            if self._first_alone:
                self._first_alone = False
                tokens, self._tokens = self._tokens[:1], self._tokens[1:]
                logprobs, self._logprobs = self._logprobs[:1], self._logprobs[1:]
            else:
                tokens, self._tokens = self._tokens, []
                logprobs, self._logprobs = self._logprobs, []
            finish = self._finish if not self._tokens else ""
            cached, self._cached = self._cached, 0
            return Tokens(tokens, logprobs, finish, cached)
        if self._finish:
            return Tokens([], [], self._finish, 0)
        assert self._error is not None
        raise self._error

    def close(self) -> None:
        """The request is over for the router: end it on the node unless it ended there."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ended or self._finish:
            self._channel.forget(self.request_id)
        else:
            self._channel.cancel(self.request_id)


# A node's RelayOutput.error_code (a gRPC status number) as a failure.
_STATUS = {code.value[0]: from_grpc(code) for code in grpc.StatusCode}
