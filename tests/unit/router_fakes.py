"""Scripted prefill and decode nodes behind fake gRPC stubs, for the router's stages without
processes or sockets: the "model" answers a prompt with its tokens reversed, then EOS.

``FakeNodes`` is the shared state (what each decode node holds for a request, who was released or
cancelled, what to refuse next); ``FakeRegistry`` a ``NodeRegistry`` whose stubs are these fakes.
Every node waits a random moment (``max_delay_s``) before each answer, so a cancellation lands
at a different point each time.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Coroutine

import grpc
from support.router_helpers import EOS

from splitserve.router.registry import NodeRegistry
from splitserve.router.request import GenerateError
from splitserve.v1 import nodes_pb2

_CANCELLED = object()


def refused_at_once(call: Coroutine[object, object, object]) -> GenerateError:
    """The ``GenerateError`` a coroutine (``Admission.enter``, say) raises before it first
    suspends: refused at once, before it waited for anything, whatever the machine's speed.
    Fails if it suspends instead (it queued)."""
    try:
        call.send(None)
    except GenerateError as refused:
        return refused
    except StopIteration:
        raise AssertionError("it returned instead of being refused") from None
    call.close()
    raise AssertionError("it suspended (queued) instead of being refused at once")


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeUnary:
    """A unary call: awaitable once, cancellable."""

    def __init__(self, answer: Awaitable) -> None:
        self._task = asyncio.ensure_future(answer)

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> bool:
        return self._task.cancel()


class FakeRelay:
    """A ``Relay`` stream: each command's request served by the fake node's decode or generate
    handler in a task of its own, each of their messages sent as its request's part of a
    ``RelayBatch``, a failure as an error output; a cancel command cancels the handler. Iterate
    it for the batches; ``cancel`` ends it (CancelledError to the reader, as grpc.aio does)."""

    def __init__(self, nodes: FakeNodes, address: str, commands: AsyncIterator) -> None:
        self._nodes, self._address = nodes, address
        self._out: asyncio.Queue = asyncio.Queue()
        self._handlers: dict[str, asyncio.Task] = {}
        self.started: list[str] = []  # request ids of its decode and generate commands
        self.cancels: list[str] = []  # request ids of its cancel commands
        self.cancelled = False
        self._answered = asyncio.get_running_loop().create_future()
        if not nodes.relay_implemented:  # a decode node of an older version
            error = rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            self._answered.set_exception(error)
            self._answered.exception()  # retrieved, whether or not the router awaits it
            self._out.put_nowait(error)
            return
        self._answered.set_result(())
        self._reader = asyncio.ensure_future(self._consume(commands))

    async def _consume(self, commands: AsyncIterator) -> None:
        async for command in commands:
            kind = command.WhichOneof("kind")
            if kind == "cancel":
                self.cancels.append(command.cancel)
                handler = self._handlers.pop(command.cancel, None)
                if handler is not None:
                    handler.cancel()
                continue
            if kind not in ("decode", "generate"):
                continue  # a lease: this fake node grants none (its GetStats says so)
            if kind == "decode":
                request = command.decode
                rid, messages = request.request_id, self._nodes.decode_started(request)
            else:
                request = command.generate
                rid, messages = request.request_id, self._nodes.generate(self._address, request)
            self.started.append(rid)
            self._handlers[rid] = asyncio.ensure_future(self._serve(rid, messages))

    async def _serve(self, rid: str, messages: AsyncIterator) -> None:
        try:
            async for msg in messages:
                out = nodes_pb2.RelayOutput(
                    request_id=rid,
                    token_ids=msg.token_ids,
                    logprobs=msg.logprobs,
                    finish_reason=msg.finish_reason,
                    cached_tokens=msg.cached_tokens,
                )
                self._out.put_nowait(nodes_pb2.RelayBatch(outputs=[out]))
        except grpc.aio.AioRpcError as exc:
            out = nodes_pb2.RelayOutput(
                request_id=rid, error_code=exc.code().value[0], error_message=exc.details() or ""
            )
            self._out.put_nowait(nodes_pb2.RelayBatch(outputs=[out]))
        finally:
            self._handlers.pop(rid, None)

    async def initial_metadata(self):
        return await self._answered

    async def __aiter__(self):
        while True:
            item = await self._out.get()
            if item is _CANCELLED:
                raise asyncio.CancelledError
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            yield item

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """The stream fails as a node that went would fail it."""
        for handler in self._handlers.values():
            handler.cancel()
        self._out.put_nowait(rpc_error(code, details))

    def cancel(self) -> bool:
        if self.cancelled:
            return False
        self.cancelled = True
        for handler in self._handlers.values():
            handler.cancel()
        self._out.put_nowait(_CANCELLED)
        return True


class FakeNodes:
    def __init__(self, rng: random.Random | None = None, max_delay_s: float = 0.0) -> None:
        self.rng = rng or random.Random(0)
        self.max_delay_s = max_delay_s
        self.held: dict[str, list[int]] = {}  # decode side: node request id → tokens to send
        self.prefill_calls: list[tuple[str, str]] = []  # (prefill node, decode node)
        self.generate_calls: list[str] = []  # decode nodes of generate commands (direct route)
        self.released: list[str] = []  # node request ids of Release calls
        self.decode_cancelled: list[str] = []  # node request ids of cancelled decodes and generates
        self.refuse_prefill = 0  # the next n Prefill calls answer RESOURCE_EXHAUSTED
        self.fail_prefill = 0  # the next n Prefill calls answer UNAVAILABLE
        self.refuse_generate = 0  # the next n generate commands fail RESOURCE_EXHAUSTED
        self.relay_implemented = True  # False: a decode node of an older version, no Relay
        self.relays: list[FakeRelay] = []  # every Relay stream opened
        self.probe_ok = True  # what grpc.health.v1 says of every node
        self.cached_tokens = 3
        self.shipped = ("", 0, 0)  # what Prefill reports it shipped: path, blocks, bytes

    async def pause(self) -> None:
        if self.max_delay_s:
            await asyncio.sleep(self.rng.uniform(0, self.max_delay_s))

    def answer(self, prompt, max_tokens: int) -> list[int]:
        return [*list(prompt)[::-1], EOS][:max_tokens]

    async def prefill(self, p: str, request: nodes_pb2.PrefillRequest):
        self.prefill_calls.append((p, request.decode_address))
        await self.pause()
        if self.refuse_prefill:
            self.refuse_prefill -= 1
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
        if self.fail_prefill:
            self.fail_prefill -= 1
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        answer = self.answer(request.prompt_token_ids, request.sampling.max_tokens)
        finish = ""
        if len(answer) == 1:
            finish = "stop" if answer[0] == EOS else "length"
        else:  # shipped: D holds the KV until a decode command or Release claims it
            self.held[request.request_id] = answer[1:]
        path, blocks, nbytes = self.shipped if not finish else ("", 0, 0)
        return nodes_pb2.PrefillResponse(
            first_token_id=answer[0],
            finish_reason=finish,
            cached_tokens=self.cached_tokens,
            transfer_path=path,
            blocks_shipped=blocks,
            bytes_shipped=nbytes,
        )

    def decode_started(self, request: nodes_pb2.DecodeRequest):
        """A Relay decode command: the KV is taken at once (the node starts every command it
        reads, so a cancel that follows always finds it)."""
        return self.decode_taken(request.request_id, self.held.pop(request.request_id, None))

    async def decode_taken(self, rid: str, tokens: list[int] | None):
        if tokens is None:
            raise rpc_error(grpc.StatusCode.NOT_FOUND, "unknown request")
        try:
            for i in range(0, len(tokens), 2):
                await self.pause()
                last = i + 2 >= len(tokens)
                finish = ("stop" if tokens[-1] == EOS else "length") if last else ""
                yield nodes_pb2.RelayOutput(token_ids=tokens[i : i + 2], finish_reason=finish)
        except asyncio.CancelledError:
            self.decode_cancelled.append(rid)
            raise

    async def generate(self, d: str, request: nodes_pb2.GenerateOnNodeRequest):
        self.generate_calls.append(d)
        await self.pause()
        if self.refuse_generate:
            self.refuse_generate -= 1
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
        answer = self.answer(request.prompt_token_ids, request.sampling.max_tokens)
        try:
            for i, token in enumerate(answer):
                if i:
                    await self.pause()
                last = i == len(answer) - 1
                finish = ("stop" if token == EOS else "length") if last else ""
                yield nodes_pb2.RelayOutput(
                    token_ids=[token], finish_reason=finish, cached_tokens=5 if i == 0 else 0
                )
        except asyncio.CancelledError:
            self.decode_cancelled.append(request.request_id)
            raise

    async def release(self, request: nodes_pb2.ReleaseRequest):
        await self.pause()
        self.released.append(request.request_id)
        held = self.held.pop(request.request_id, None)
        return nodes_pb2.ReleaseResponse(released=held is not None)


class _PrefillStub:
    def __init__(self, nodes: FakeNodes, address: str) -> None:
        self._nodes, self._address = nodes, address

    def Prefill(self, request, timeout=None, metadata=None) -> FakeUnary:
        return FakeUnary(self._nodes.prefill(self._address, request))


class _DecodeStub:
    def __init__(self, nodes: FakeNodes, address: str) -> None:
        self._nodes, self._address = nodes, address

    def Release(self, request, timeout=None, metadata=None) -> FakeUnary:
        return FakeUnary(self._nodes.release(request))

    def Relay(self, commands, timeout=None, metadata=None) -> FakeRelay:
        relay = FakeRelay(self._nodes, self._address, commands)
        self._nodes.relays.append(relay)
        return relay


class FakeRegistry(NodeRegistry):
    """Both pools (``p0``.., ``d0``..) over ``FakeNodes``; no channel is ever opened."""

    def __init__(self, nodes: FakeNodes, num_prefill: int = 2, num_decode: int = 2) -> None:
        super().__init__(
            [f"p{i}" for i in range(num_prefill)], [f"d{i}" for i in range(num_decode)]
        )
        self.fake = nodes

    def prefill_stub(self, node):  # type: ignore[override]
        return _PrefillStub(self.fake, node.address)

    def decode_stub(self, node):  # type: ignore[override]
        return _DecodeStub(self.fake, node.address)

    async def probe(self, node, timeout: float = 1.0) -> bool:
        return self.fake.probe_ok


def all_given_back(registry: NodeRegistry) -> list[str]:
    """What the router still counts on any node (empty: every slot, queued token and KV ledger
    entry taken was given back)."""
    left = []
    for node in registry.prefill.nodes:
        if node.in_flight or node.queued_tokens:
            left.append(f"{node.address}: {node.in_flight} {node.queued_tokens}")
    for node in registry.decode.nodes:
        if node.in_flight or node.queued_tokens or node.kv.used:
            left.append(f"{node.address}: {node.in_flight} {node.queued_tokens} {node.kv.used}")
    return left
