"""A decode node's Relay stream from the tests' side: the router's half (``Commands``,
``relay_one``) against a real node, and a Relay servicer for fake decode nodes that answer each
request with a generator of their own (``serve_relay``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from splitserve.v1 import nodes_pb2


class Commands:
    """The router's side of the stream: commands put here are sent in order; None ends it."""

    def __init__(self, *commands: nodes_pb2.RelayCommand) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        for command in commands:
            self.queue.put_nowait(command)

    async def __aiter__(self):
        while (command := await self.queue.get()) is not None:
            yield command


async def relay_one(
    stub, command: nodes_pb2.RelayCommand, timeout: float = 60
) -> list[nodes_pb2.RelayOutput]:
    """One request (a decode or generate command) on a Relay stream of its own: its outputs, to
    its finish or its error; then the stream is closed."""
    rid = command.decode.request_id if command.HasField("decode") else command.generate.request_id
    commands = Commands(command)
    call = stub.Relay(commands, timeout=timeout)
    outputs: list[nodes_pb2.RelayOutput] = []
    try:
        async for batch in call:
            for out in batch.outputs:
                if out.request_id == rid:
                    outputs.append(out)
            if outputs and (outputs[-1].finish_reason or outputs[-1].error_code):
                return outputs
    finally:
        commands.queue.put_nowait(None)
        call.cancel()
    return outputs


def tokens_of(outputs: list[nodes_pb2.RelayOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class RequestContext:
    """What a fake node's per-request handler may use of a servicer context: ``abort``."""

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise _Aborted(code, details)


Handler = Callable[[nodes_pb2.RelayCommand, RequestContext], AsyncIterator[nodes_pb2.RelayOutput]]


async def serve_relay(
    commands: AsyncIterator[nodes_pb2.RelayCommand],
    context: grpc.aio.ServicerContext,
    handler: Handler,
) -> AsyncIterator[nodes_pb2.RelayBatch]:
    """A fake decode node's ``Relay``: each decode or generate command runs ``handler`` (an async
    generator of the request's RelayOutputs; ``context.abort`` fails the request) in a task of
    its own; every output goes out in a batch of its own with the request's id; a cancel command
    cancels the request's task; the stream's end cancels them all."""
    await context.send_initial_metadata(())
    out: asyncio.Queue = asyncio.Queue()
    tasks: dict[str, asyncio.Task] = {}

    async def one(rid: str, command: nodes_pb2.RelayCommand) -> None:
        try:
            async for message in handler(command, RequestContext()):
                message.request_id = rid
                out.put_nowait(nodes_pb2.RelayBatch(outputs=[message]))
        except _Aborted as exc:
            failed = nodes_pb2.RelayOutput(
                request_id=rid, error_code=exc.code.value[0], error_message=exc.details
            )
            out.put_nowait(nodes_pb2.RelayBatch(outputs=[failed]))
        finally:
            tasks.pop(rid, None)

    async def read() -> None:
        async for command in commands:
            kind = command.WhichOneof("kind")
            if kind == "cancel":
                task = tasks.pop(command.cancel, None)
                if task is not None:
                    task.cancel()
            elif kind in ("decode", "generate"):
                rid = getattr(command, kind).request_id
                tasks[rid] = asyncio.ensure_future(one(rid, command))
        out.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (batch := await out.get()) is not None:
            yield batch
    finally:
        reader.cancel()
        for task in list(tasks.values()):
            task.cancel()


class RelayFailed(grpc.RpcError):
    """A request's error output on a Relay stream, read like a failed call's status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class SyncRelayCall:
    """One request on a Relay stream of its own, from a blocking stub: iterate its outputs (an
    error output raises ``RelayFailed``; the finish ends the iteration); ``cancel`` ends the
    stream, which ends the request on the node."""

    def __init__(self, stub, command: nodes_pb2.RelayCommand, timeout: float = 60, metadata=None):
        import threading

        kind = command.WhichOneof("kind")
        self.request_id = getattr(command, kind).request_id
        self._done = threading.Event()

        def commands():
            yield command
            self._done.wait(timeout)  # the stream stays open while the request runs

        self._call = stub.Relay(commands(), timeout=timeout, metadata=metadata)

    def __iter__(self):
        try:
            for batch in self._call:
                for out in batch.outputs:
                    if out.request_id != self.request_id:
                        continue
                    if out.error_code:
                        raise RelayFailed(
                            _STATUS.get(out.error_code, grpc.StatusCode.UNKNOWN), out.error_message
                        )
                    yield out
                    if out.finish_reason:
                        return
        finally:
            self.cancel()

    def cancel(self) -> None:
        self._done.set()
        self._call.cancel()


def decode_on_relay(stub, request_id: str, timeout: float = 60, metadata=None) -> list[int]:
    """Decode a transferred request to its end on a Relay stream of its own: its tokens."""
    command = nodes_pb2.RelayCommand(decode=nodes_pb2.DecodeRequest(request_id=request_id))
    return [t for out in SyncRelayCall(stub, command, timeout, metadata) for t in out.token_ids]
