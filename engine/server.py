"""The engine process's side of ``engine.protocol``: a ``LocalEngine`` answering the front's
commands, and the engine thread writing each step's outputs itself.

Commands run as tasks on this process's event loop, concurrently (a transfer waiting in a thread
does not hold up an ``abort``); each runs to its end whatever happens to the front's caller, so a
release the front sent is always done. When the front's connection ends (the node process exited
or was killed), the engine stops: nothing runs on for a front that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from typing import Any

from splitserve.engine.core import StepOutput
from splitserve.engine.local import LocalEngine
from splitserve.engine.protocol import (
    CALL,
    COMMANDS,
    FAILED,
    REPLY,
    error_value,
    frame,
    frame_length,
    outputs_value,
    unpackb,
)

logger = logging.getLogger(__name__)


class OutputWriter:
    """Writes step outputs to the front from the engine thread (a blocking socket: a front that
    does not read holds the engine back rather than piling outputs up here)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self._sock = sock
        self._lock = threading.Lock()
        self.broken = False
        self.frames = 0

    def deliver(self, outputs: list[StepOutput]) -> None:
        try:
            data = frame(outputs_value(outputs))
        except (TypeError, ValueError) as exc:  # a value the protocol cannot carry: a bug
            logger.exception("a step's outputs do not encode: their requests fail")
            self.fail(sorted({o.request_id for o in outputs}), RuntimeError(str(exc)))
            return
        self._send(data)

    def fail(self, request_ids: list[str], exc: BaseException) -> None:
        kind, message = error_value(exc)
        self._send(frame([FAILED, list(request_ids), kind, message]))

    def _send(self, data: bytes) -> None:
        with self._lock:
            if self.broken:
                return
            try:
                self._sock.sendall(data)
                self.frames += 1
            except OSError:
                self.broken = True  # the front is gone: the command side ends the process

    def close(self) -> None:
        with self._lock:
            self.broken = True
            with contextlib.suppress(OSError):
                self._sock.close()


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's value; ``asyncio.IncompleteReadError`` at the end of the connection."""
    n = frame_length(await reader.readexactly(4))
    return unpackb(await reader.readexactly(n))


async def serve_commands(
    engine: LocalEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> str:
    """Answer commands until ``stop`` or the end of the connection; returns why it ended. The
    engine is stopped either way."""
    tasks: set[asyncio.Task] = set()
    stopped = asyncio.Event()

    def reply(seq: int, ok: bool, value: Any) -> None:
        if writer.is_closing():
            return
        try:
            writer.write(frame([REPLY, seq, ok, value]))
        except TypeError as exc:  # a value of a type the protocol does not carry: a bug here
            writer.write(frame([REPLY, seq, False, ["RuntimeError", f"unencodable: {exc}"]]))

    async def run(seq: int, name: str, args: list) -> None:
        try:
            if name == "stop":
                await engine.stop()
                reply(seq, True, None)
                stopped.set()
                return
            value = await getattr(engine, name)(*args)
        except asyncio.CancelledError:
            reply(seq, False, ["EngineGone", "the engine process is stopping"])
            raise
        except BaseException as exc:
            reply(seq, False, error_value(exc))
            return
        reply(seq, True, value)

    async def commands() -> str:
        while True:
            try:
                message = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return "the node's front closed the connection"
            except ValueError as exc:
                return f"a bad frame from the front: {exc}"
            if (
                not isinstance(message, list)
                or len(message) != 4
                or message[0] != CALL
                or not isinstance(message[1], int)
            ):
                logger.error("engine process: a malformed command %.200r: ignored", message)
                continue
            if message[2] not in COMMANDS or not isinstance(message[3], list):
                reply(message[1], False, ["ValueError", f"no command {message[2]!r:.100}"])
                continue
            _, seq, name, args = message
            task = asyncio.create_task(run(seq, name, args))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    reading = asyncio.create_task(commands())
    stopping = asyncio.create_task(stopped.wait())
    done, _ = await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    why = reading.result() if reading in done else "stopped by the node"
    reading.cancel()
    stopping.cancel()
    await engine.stop()  # idempotent: a stop command already did
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()
    writer.close()
    return why
