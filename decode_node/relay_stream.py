"""One router's ``Relay`` stream on a decode node: every request that router starts here, their
tokens sent once per engine step in one ``RelayBatch``.

A request's outputs go from the engine straight into its ``_Live`` entry (``NodeEngine``'s
sink, on the event loop, a whole step's at a time); an entry with something to send is marked
ready and the stream's one writer wakes once, builds one message of every ready request and
sends it. While the router reads slower than the engine steps, outputs pile up in the entries
and go out together: the stream never falls further behind by sending more messages.

Each request has a task of its own for its start (the pending table, the engine's queue) and its
end (``DecodeService.end``: its blocks freed to the end). A ``cancel`` command, the request's
deadline or the stream's end (the router went, or closed it) ends the request: the task, never
cancelled itself, ends it as soon as it has started. Commands are read in order by one reader,
so a cancel always finds the start it follows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, Protocol

from splitserve.decode_node.header import Refused
from splitserve.decode_node.leases import Holder, LeaseBook
from splitserve.engine.api import OutputSink
from splitserve.engine.core import StepOutput
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime import counter_names as names
from splitserve.runtime import tracing
from splitserve.runtime.failure import Failure
from splitserve.runtime.node import failure_code
from splitserve.runtime.status import to_grpc
from splitserve.v1 import nodes_pb2

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 1024  # a command's request id (input from another process: bounded)
MAX_DEADLINE_S = 86400.0  # a command's deadline_s beyond this (or not finite) is ignored


class Requests(Protocol):
    """What a relay stream needs of its node's service (``DecodeService``): starting and ending
    requests, and the books a drain and metrics read."""

    counters: Counter[str]
    stream_interval: int  # tokens per output after the first, at most (--stream-interval)
    calls: int  # requests in flight, for the drain
    relay_tasks: set[asyncio.Task[None]]  # every stream's requests (they may outlive it)
    relay_streams: set[Any]  # the streams open (one per router)
    leases: LeaseBook  # the routers' shares of this node

    def start_decode(self, rid: str, sink: OutputSink) -> None: ...

    async def join_decode(self, rid: str) -> None: ...

    def start_generate(
        self, request: nodes_pb2.GenerateOnNodeRequest, sink: OutputSink
    ) -> tuple[list[int], SamplingParams]: ...

    async def join_generate(
        self, request: nodes_pb2.GenerateOnNodeRequest, prompt: list[int], params: SamplingParams
    ) -> None: ...

    async def end(self, rid: str, finished: bool) -> None: ...

    def count_direct(self, prompt_tokens: int, cached_tokens: int) -> None: ...


class _Live:
    """One request of the stream: its outputs not sent yet and how it ended."""

    __slots__ = (
        "cached",
        "done",
        "failure",
        "finished",
        "first_at",
        "logprobs",
        "produced",
        "prompt_tokens",
        "request_id",
        "sent_first",
        "stream",
        "timer",
        "tokens",
    )

    def __init__(self, stream: RelayStream, request_id: str) -> None:
        self.stream = stream
        self.request_id = request_id
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.cached = -1  # the first token's cached prompt tokens, until sent (-1: not known)
        self.finished = ""  # the engine's finish reason
        self.failure: tuple[Failure, str] | None = None
        self.sent_first = False
        self.prompt_tokens = 0  # a whole request's (generate): counted at its first token
        self.done = asyncio.get_running_loop().create_future()  # resolved at the request's end
        self.timer: asyncio.TimerHandle | None = None
        self.first_at = 0.0  # time.monotonic() of its first token (the trace's queue span)
        self.produced = 0  # tokens the engine gave it

    def put_nowait(self, out: StepOutput | BaseException) -> None:
        """The engine's next output for the request (``engine.api.OutputSink``)."""
        if self.finished or self.failure is not None:
            return
        if isinstance(out, BaseException):
            self.fail(failure_code(out), f"decoding failed: {out}")
            return
        self.tokens.append(out.new_token_id)
        self.produced += 1
        if not self.first_at:
            self.first_at = time.monotonic()
        if out.logprob is not None:
            self.logprobs.append(out.logprob)
        if out.facts is not None:
            self.cached = out.facts.num_cached_tokens
            if self.prompt_tokens:
                self.stream.count_direct(self.prompt_tokens, self.cached)
        if out.finish_reason is not None:
            self.finished = out.finish_reason
            self.stream.counters[names.REQUESTS_FINISHED] += 1
            self._end()
        if not self.sent_first or self.finished or len(self.tokens) >= self.stream.interval:
            self.stream.ready(self)

    def fail(self, code: Failure, message: str) -> None:
        """End the request with ``code``: sent after the tokens before it."""
        if self.finished or self.failure is not None:
            return
        self.failure = (code, message)
        self.stream.ready(self)
        self._end()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.timer is not None:
            self.timer.cancel()

    def take(self, out: nodes_pb2.RelayOutput) -> None:
        """Move what is not sent yet into ``out``."""
        out.request_id = self.request_id
        if self.tokens:
            out.token_ids.extend(self.tokens)
            self.tokens.clear()
            if self.logprobs:
                out.logprobs.extend(self.logprobs)
                self.logprobs.clear()
            self.sent_first = True
        if self.cached >= 0:
            out.cached_tokens = self.cached
            self.cached = -1
        if self.finished:
            out.finish_reason = self.finished
        elif self.failure is not None:
            out.error_code = to_grpc(self.failure[0]).value[0]
            out.error_message = self.failure[1]


class RelayStream:
    """Serves one ``Relay`` call of ``service`` (``DecodeService``)."""

    def __init__(self, service: Requests) -> None:
        self._service = service
        self.counters = service.counters
        self.interval = service.stream_interval  # tokens per output after the first, at most
        self._live: dict[str, _Live] = {}
        self._ready: dict[str, _Live] = {}  # with something to send, in the order they became so
        self._wake = asyncio.Event()
        self._granted = False  # the router's share changed since the last batch
        self._holder: Holder | None = None  # this router's lease, while the stream runs

    def count_direct(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._service.count_direct(prompt_tokens, cached_tokens)

    def ready(self, live: _Live) -> None:
        self._ready[live.request_id] = live
        self._wake.set()

    def _on_grant(self, _: Holder) -> None:
        self._granted = True
        self._wake.set()

    async def run(
        self, commands: AsyncIterator[nodes_pb2.RelayCommand]
    ) -> AsyncIterator[nodes_pb2.RelayBatch]:
        leases = self._service.leases
        self._holder = holder = leases.join(self._on_grant)
        reader = asyncio.create_task(self._read(commands))
        reader.add_done_callback(lambda _: self._wake.set())
        self._service.relay_streams.add(self)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._ready or self._granted:
                    ready, self._ready = self._ready, {}
                    batch = nodes_pb2.RelayBatch()
                    outputs = batch.outputs
                    for live in ready.values():
                        live.take(outputs.add())
                    if self._granted:
                        self._granted = False
                        batch.grant.share_ppm = holder.granted
                        batch.grant.seq = holder.seq
                    yield batch
                if reader.done():
                    if not reader.cancelled() and reader.exception() is not None:
                        logger.warning("relay stream: commands failed: %r", reader.exception())
                    return
        finally:
            reader.cancel()
            self._close()
            self._service.relay_streams.discard(self)
            self._holder = None
            leases.leave(holder)

    def _close(self) -> None:
        """The stream ended (the router closed it or went): end every request it started."""
        for live in list(self._live.values()):
            live.fail(Failure.CANCELLED, "the router's relay stream ended")

    async def _read(self, commands: AsyncIterator[nodes_pb2.RelayCommand]) -> None:
        async for command in commands:
            kind = command.WhichOneof("kind")
            if kind == "cancel":
                live = self._live.get(command.cancel)
                if live is not None:
                    live.fail(Failure.CANCELLED, "cancelled by the router")
                continue
            if kind == "lease":
                if self._holder is not None:
                    lease = command.lease
                    self._service.leases.update(
                        self._holder, lease.want_ppm, lease.used_ppm, lease.seen_grant
                    )
                continue
            if kind is None:
                continue  # a newer router's command this node does not know
            request = command.decode if kind == "decode" else command.generate
            rid = request.request_id
            live = _Live(self, rid)
            if not rid or len(rid) > MAX_REQUEST_ID_CHARS:
                live.fail(
                    Failure.INVALID,
                    f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}",
                )
                continue
            if rid in self._live:
                live.fail(Failure.ALREADY_EXISTS, f"request {rid!r} is already on this stream")
                continue
            self._live[rid] = live
            task = asyncio.create_task(self._serve(live, command, kind))
            tasks = self._service.relay_tasks  # held there: they outlive the stream
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if 0 < command.deadline_s <= MAX_DEADLINE_S:  # NaN, inf, <= 0: none but the node's
                live.timer = asyncio.get_running_loop().call_later(
                    command.deadline_s, self._expire, live
                )
        # The router closed its side (it is stopping): its requests end with the stream.

    def _expire(self, live: _Live) -> None:
        live.fail(Failure.DEADLINE, "the request's deadline passed on the node")

    async def _serve(self, live: _Live, command: nodes_pb2.RelayCommand, kind: str) -> None:
        """One request from its start to its end. A cancel, its deadline or the stream's end
        fails ``live``, which resolves ``done``: the request is ended as soon as it started (a
        transferred request is always started, so that its KV is freed now)."""
        service = self._service
        rid = live.request_id
        if kind == "generate" and live.failure is not None:
            self._live.pop(rid, None)
            return  # cancelled before it started: nothing of it is here
        method = "Decode" if kind == "decode" else "Generate"
        traced = tracing.start(f"decode_node.{method}", carrier=dict(command.trace), server=True)
        begun = time.monotonic()
        started = False
        service.calls += 1  # a drain waits for it
        try:
            if kind == "decode":
                service.start_decode(rid, live)
                started = True
                await service.join_decode(rid)
            else:
                request = command.generate
                prompt, params = service.start_generate(request, live)
                started = True
                live.prompt_tokens = len(prompt)
                await service.join_generate(request, prompt, params)
            await live.done
        except Refused as exc:
            live.fail(exc.code, str(exc))
        finally:
            try:
                if started:
                    await service.end(rid, bool(live.finished))
            finally:
                service.calls -= 1
                self._live.pop(rid, None)
                live.fail(Failure.CANCELLED, "the request was cancelled")
                if traced.span.is_recording():
                    if live.first_at:  # its wait for the first token, in the engine's queue
                        tracing.record("queue", begun, live.first_at)
                    traced.span.set_attributes(
                        {"splitserve.request_id": rid, "splitserve.tokens": live.produced}
                    )
                failure = live.failure
                traced.end(None if failure is None else f"{failure[0].value}: {failure[1]}")
