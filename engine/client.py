"""EngineClient: ``NodeEngine`` for a node whose engine runs in a process of its own.

Every command is one frame to the engine process and one reply (``engine.protocol``); many may
be in flight. A step's outputs arrive as one frame and are handed to the requests' queues here.
Commands that must complete (releases, reservations, sends) are awaited through cancellations
of their caller (``settle``): the engine process runs every command it received to its end, and
the caller hears of its cancellation once it has. A pin whose caller is cancelled before the
answer is unpinned when the answer comes.

When the engine process goes (it exited, was killed, or its connection broke), every command in
flight and every request's queue gets ``EngineGone``, and ``on_gone`` is called once (the node
then exits: it cannot serve without its engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

import splitserve.settings as settings
from splitserve.engine import lifeline
from splitserve.engine.api import (
    EngineFigures,
    EngineInfo,
    KVSides,
    KVSpec,
    NodeEngine,
    Pinned,
    Reserved,
    ResInfo,
)
from splitserve.engine.loop import settle
from splitserve.engine.protocol import (
    CALL,
    FAILED,
    HELLO,
    MAX_FRAME,
    OUTPUTS,
    REPLY,
    START,
    VERSION,
    EngineGone,
    error_of,
    frame,
    frame_length,
    outputs_of,
    unpackb,
)
from splitserve.kvstore import BlockHash
from splitserve.kvstore.block_pool import BlockStored, KVCacheEvent
from splitserve.models.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FIGURES_EVERY_S = 0.5  # how often last_figures is refreshed (the metrics thread's read)
# Stopping the engine process takes this long at most, all of it (its last replies, its exit);
# then it is killed (and its tensor-parallel ranks with it: engine.lifeline), so a node whose
# engine is stuck (a rank stopped in a collective) still ends. SPLITSERVE_ENGINE_STOP_TIMEOUT_S
# sets it (seconds; e.g. to fit a container's stop grace period).
STOP_TIMEOUT_S = settings.ENGINE_STOP_TIMEOUT_S.default


def stop_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """How long stopping the engine process may take (``STOP_TIMEOUT_S`` unless the variable
    sets it); ``ValueError`` naming the variable for a bad value."""
    return settings.ENGINE_STOP_TIMEOUT_S.get(env)


ADOPT_BYTES = 64 << 20  # the most block bytes one adopt command carries


async def _read(reader: asyncio.StreamReader) -> Any:
    n = frame_length(await reader.readexactly(4))
    return unpackb(await reader.readexactly(n))


def reap(process: subprocess.Popen, timeout: float) -> None:
    """Wait for the engine process to exit; kill it after ``timeout`` seconds, and give up on it
    (an error logged) if it outlives the kill by ``lifeline.KILL_WAIT_S``."""
    lifeline.reap(process, timeout, "the engine process")


class EngineClient(NodeEngine):
    def __init__(
        self,
        commands: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        outputs: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        on_gone: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__()
        self._reader, self._writer = commands
        self._outputs, self._outputs_writer = outputs  # (the writer: unused, kept open)
        self._on_gone = on_gone
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._figures = EngineFigures()
        self.gone: str | None = None  # why the engine process went (None: it is there)
        self.process: subprocess.Popen | None = None  # the engine process, reaped by stop
        self._stopping = False
        self._stop_timeout_s = stop_timeout_s()  # a bad value fails the node's start, not its stop
        self.steps_received = 0  # OUTPUTS frames

    async def connect(self, role: str, config: dict[str, Any]) -> EngineInfo:
        """Send the node's role and config; wait until the engine process has loaded the model
        (its HELLO), or raise ``RuntimeError`` with its reason."""
        self._writer.write(frame([START, VERSION, role, config]))
        try:
            hello = await _read(self._reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise EngineGone("the engine process ended before it was ready") from exc
        if isinstance(hello, list) and len(hello) == 4 and hello[0] == REPLY:
            raise RuntimeError(f"the engine process could not start: {error_of(hello[3])}")
        if not (isinstance(hello, list) and len(hello) == 3 and hello[0] == HELLO):
            raise RuntimeError(f"the engine process answered {hello!r:.200} to START")
        if hello[1] != VERSION:
            raise RuntimeError(
                f"the engine process speaks protocol version {hello[1]}, this node {VERSION}"
            )
        if not isinstance(hello[2], EngineInfo):
            raise RuntimeError("the engine process's HELLO carries no EngineInfo")
        self.info = hello[2]
        self._tasks = [
            asyncio.create_task(self._read_replies()),
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self._refresh_figures()),
        ]
        return self.info

    # ------------------------------------------------------------------ the connection

    async def _read_replies(self) -> None:
        try:
            while True:
                message = await _read(self._reader)
                if not (isinstance(message, list) and len(message) == 4 and message[0] == REPLY):
                    raise ValueError(f"not a reply: {message!r:.200}")
                _, seq, ok, value = message
                future = self._pending.pop(seq, None)
                if future is None or future.done():
                    continue  # its caller stopped waiting (a plain command)
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(error_of(value))
        except (asyncio.IncompleteReadError, ConnectionError):
            self._lost("its connection closed")
        except Exception as exc:  # a frame that does not decode: nothing after it can be trusted
            self._lost(f"a bad frame on its connection: {exc!r}")

    async def _read_outputs(self) -> None:
        try:
            while True:
                message = await _read(self._outputs)
                if isinstance(message, list) and len(message) == 2 and message[0] == OUTPUTS:
                    self.steps_received += 1
                    self._deliver(outputs_of(message[1]))
                elif isinstance(message, list) and len(message) == 4 and message[0] == FAILED:
                    rids = [str(r) for r in message[1]]
                    for rid in rids:
                        self._fail([rid], error_of([message[2], message[3]], rid))
                else:
                    raise ValueError(f"not an output frame: {message!r:.200}")
        except (asyncio.IncompleteReadError, ConnectionError):
            self._lost("its outputs connection closed")
        except Exception as exc:
            self._lost(f"a bad outputs frame: {exc!r}")

    async def _refresh_figures(self) -> None:
        while self.gone is None:
            with contextlib.suppress(Exception):
                await self.figures()
            await asyncio.sleep(FIGURES_EVERY_S)

    def _lost(self, why: str) -> None:
        if self.gone is not None:
            return
        self.gone = why
        error = EngineGone(f"the engine process is gone ({why})")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self._fail(list(self._queues), error)
        if not self._stopping:
            logger.error("engine process gone: %s", why)
            if self._on_gone is not None:
                self._on_gone(why)

    def _send(self, name: str, args: list) -> asyncio.Future:
        if self.gone is not None:
            raise EngineGone(f"the engine process is gone ({self.gone})")
        seq = next(self._seq)
        data = frame([CALL, seq, name, args])  # TypeError for a value the protocol cannot carry
        if len(data) - 4 > MAX_FRAME:
            raise ValueError(f"a {name} command of {len(data)} bytes (max {MAX_FRAME})")
        future = asyncio.get_running_loop().create_future()
        self._pending[seq] = future
        self._writer.write(data)
        return future

    async def _call(self, name: str, *args: Any) -> Any:
        return await self._send(name, list(args))

    async def _call_to_end(self, name: str, *args: Any) -> Any:
        return await settle(self._send(name, list(args)))

    # ------------------------------------------------------------------ life

    async def stop(self) -> None:
        """Stop the engine process: it answers the commands still running (cancelled ones with
        EngineGone) and closes; what is left unanswered then fails here, later commands raise
        EngineGone, and the process is waited for (killed after ``stop_timeout_s()``)."""
        if self._stopping:
            return
        self._stopping = True
        loop = asyncio.get_running_loop()
        end = loop.time() + self._stop_timeout_s  # one deadline for every step below

        def left() -> float:
            return max(end - loop.time(), 0.0)

        if self.gone is None:
            with contextlib.suppress(EngineGone, TimeoutError, ConnectionError):
                await asyncio.wait_for(self._send("stop", []), left())
            if self._tasks and left() > 0:  # the replies to the end of the connection
                await asyncio.wait({self._tasks[0]}, timeout=left())
        self._lost("stopped")  # anything still unanswered fails now, not never
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.process is not None:
            await asyncio.to_thread(reap, self.process, max(left(), 0.5))
        for writer in (self._writer, self._outputs_writer):
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    # ------------------------------------------------------------------ requests

    async def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, salt: str | None
    ) -> None:
        await self._call("add_request", request_id, prompt, params, salt)

    async def add_transferred(
        self,
        request_id: str,
        prompt: list[int],
        first_token: int,
        params: SamplingParams,
        salt: str | None,
    ) -> None:
        await self._call("add_transferred", request_id, prompt, first_token, params, salt)

    async def abort(self, request_id: str) -> None:
        await self._call_to_end("abort", request_id)

    async def end_request(self, request_id: str) -> bool:
        return await self._call_to_end("end_request", request_id)

    # ------------------------------------------------------------------ KV blocks

    async def reserve(
        self, request_id: str, block_hashes: list[BlockHash], prompt_len: int
    ) -> Reserved | None:
        return await self._call_to_end("reserve", request_id, block_hashes, prompt_len)

    async def register(self, request_id: str, block_hashes: list[BlockHash]) -> None:
        await self._call_to_end("register", request_id, block_hashes)

    async def free(self, request_id: str) -> None:
        await self._call_to_end("free", request_id)

    async def holds(self, request_id: str) -> bool:
        return await self._call("holds", request_id)

    async def count_cached(self, block_hashes: list[BlockHash]) -> int:
        return await self._call("count_cached", block_hashes)

    async def adopt(self, block_hashes: list[BlockHash], blocks_data: list[bytes]) -> int:
        # In commands of at most ADOPT_BYTES (a long prefix of a large model is GBs), in order:
        # each run is cached before the next, and a run the pool cannot take ends the adoption.
        adopted, i = 0, 0
        while i < len(block_hashes):
            j, size = i, 0
            while j < len(block_hashes) and (j == i or size + len(blocks_data[j]) <= ADOPT_BYTES):
                size += len(blocks_data[j])
                j += 1
            n = await self._call("adopt", block_hashes[i:j], blocks_data[i:j])
            adopted += n
            if n < j - i:
                break
            i = j
        return adopted

    async def pin(self, block_hashes: list[BlockHash]) -> Pinned:
        future = self._send("pin", [block_hashes])
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:

            def unpin_when_done(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None and self.gone is None:
                    self._send("unpin", [done.result().pin_id])

            future.add_done_callback(unpin_when_done)
            raise

    async def unpin(self, pin_id: int) -> None:
        await self._call_to_end("unpin", pin_id)

    async def read(self, block_ids: list[int]) -> bytes:
        return await self._call("read", block_ids)

    async def read_tier(self, block_hashes: list[BlockHash]) -> list[bytes]:
        return await self._call("read_tier", block_hashes)

    async def block_ids(self, request_id: str) -> list[int]:
        return await self._call("block_ids", request_id)

    async def take_events(self) -> list[KVCacheEvent]:
        return await self._call("take_events")

    async def cache_snapshot(self) -> list[BlockStored]:
        return await self._call("cache_snapshot")

    # ------------------------------------------------------------------ figures

    async def figures(self) -> EngineFigures:
        self._figures = await self._call("figures")
        return self._figures

    def last_figures(self) -> EngineFigures:
        return self._figures

    # ------------------------------------------------------------------ transfer sides

    async def open_kv(self, spec: KVSpec) -> KVSides:
        self.kv = await self._call("open_kv", spec)
        return self.kv

    async def rx_reserve(self, side: str, peer_id: str, block_ids: list[int], path: str) -> ResInfo:
        future = self._send("rx_reserve", [side, peer_id, block_ids, path])
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:

            def cancel_when_done(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None and self.gone is None:
                    self._send("rx_cancel", [side, done.result().res_id])

            future.add_done_callback(cancel_when_done)
            raise

    async def rx_write(self, side: str, res_id: int, block_ids: list[int], data: bytes) -> None:
        await self._call("rx_write", side, res_id, block_ids, data)

    async def rx_receive(self, side: str, res_id: int, timeout: float) -> None:
        await self._call("rx_receive", side, res_id, timeout)

    async def rx_finish(self, side: str, res_id: int, count: int | None = None) -> None:
        await self._call_to_end("rx_finish", side, res_id, count)

    async def rx_cancel(self, side: str, res_id: int) -> float:
        return await self._call_to_end("rx_cancel", side, res_id)

    async def tx_connect(self, side: str, endpoint: bytes) -> str:
        return await self._call("tx_connect", side, endpoint)

    async def tx_close(self, side: str, peer_id: str) -> None:
        await self._call("tx_close", side, peer_id)

    async def tx_send(
        self, side: str, ticket: bytes, src_block_ids: list[int], timeout: float
    ) -> int:
        return await self._call_to_end("tx_send", side, ticket, src_block_ids, timeout)

    async def tx_stream_open(
        self, side: str, ticket: bytes, request_id: str, block_index: list[int], timeout: float
    ) -> None:
        await self._call("tx_stream_open", side, ticket, request_id, block_index, timeout)

    async def tx_stream_wait(self, side: str, request_id: str) -> int:
        return await self._call_to_end("tx_stream_wait", side, request_id)
