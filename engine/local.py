"""LocalEngine: the ``NodeEngine`` commands run on an engine in this process.

Every command that touches the engine or its KV runs on the engine thread (``AsyncEngine``),
between steps; figures are read from the event loop without a job (the reads ``engine.kv_port``
allows there). The node's transfer sides live here too, beside the pool they read and write:
reservations and pins stay in tables keyed by the ids the commands answer with.

This is what an engine process serves (``engine.server``), and what a node runs in its own
process when it has no engine process (``--engine-process off``: tests, a CPU node).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import threading
import uuid
from typing import Any

from splitserve.engine.api import (
    FETCH_TX,
    RX,
    TX,
    EngineFigures,
    EngineInfo,
    KVSides,
    KVSpec,
    NodeEngine,
    Pinned,
    ResInfo,
)
from splitserve.engine.core import LLMEngine, StepOutput
from splitserve.engine.kv_port import Reserved
from splitserve.engine.layer_stream import LayerStreams
from splitserve.engine.loop import AsyncEngine, settle
from splitserve.kvstore import BlockHash
from splitserve.kvstore.block_pool import BlockStored, KVCacheEvent
from splitserve.models.sampling_params import SamplingParams
from splitserve.transfer import TP_PATHS, RankLink

logger = logging.getLogger(__name__)

FETCH_RECEIVER_MARK = "#fetch-"  # in the id of every prefill node's fetch receiver
# A message for the other ranks' transfer agents waits for the step in progress (at most one).
RANK_COMMAND_TIMEOUT_S = 30.0


class LocalEngine(NodeEngine):
    def __init__(
        self,
        core: LLMEngine,
        profile_path: str | None = None,
        deliver: Any = None,
        fail: Any = None,
        stop_timeout_s: float | None = None,
    ) -> None:
        """``deliver``/``fail``: where step outputs go, on the engine thread (an engine
        process); default: this node's ``subscribe`` queues, on its event loop.
        ``stop_timeout_s``: how long ``stop`` waits for a step to end before it ends the
        tensor-parallel ranks and leaves the engine thread (None: as long as it takes; an
        engine process's node kills it instead)."""
        super().__init__()
        self.core = core
        self._stop_timeout_s = stop_timeout_s
        self.port = core.kv_port
        on_thread = deliver is not None
        self.loop_engine = AsyncEngine(
            core,
            profile_path,
            deliver=deliver or self._deliver,
            fail=fail or self._fail,
            on_thread=on_thread,
        )
        runner = core.runner
        self.info = EngineInfo(
            root_hash=core.identity.root_hash,
            identity=str(core.identity),
            device=str(runner.device),
            max_num_seqs=core.max_num_seqs,
            max_num_batched_tokens=core.max_num_batched_tokens,
            max_model_len=runner.config.max_model_len,
            vocab_size=runner.config.vocab_size,
            block_size=self.port.block_size,
            block_nbytes=self.port.block_nbytes,
            num_usable_blocks=self.port.num_usable_blocks,
            num_params=sum(p.numel() for p in runner.model.parameters()),
            pid=os.getpid(),
            tensor_parallel_size=runner.tp.size,
            host_tier=core.host_tier is not None,
        )
        self._sides: dict[str, Any] = {}  # RX/TX/FETCH_TX → transfer.KVReceiver / KVSender
        self._reservations: dict[int, Any] = {}  # res id → transfer.Reservation
        self._pins: dict[int, list] = {}  # pin id → pinned KVCacheBlocks
        # request id → its layer-wise stream's future (tx_stream_open; dropped by its end)
        self._streams: dict[str, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._stopped = False

    def start(self) -> None:
        """Start stepping (outputs go to this event loop)."""
        self.loop_engine.start()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for side in (RX, TX, FETCH_TX):
            part = self._sides.pop(side, None)
            if part is not None:
                await asyncio.to_thread(part.shutdown if side == RX else part.close_all)
        if self._stop_timeout_s is None:
            await self._stop_steps()
            return
        try:
            # Bounded: a step or the ranks' stop stuck in a collective (a rank stopped) never
            # ends; the node must.
            await asyncio.wait_for(self._stop_steps(), self._stop_timeout_s)
        except TimeoutError:
            logger.warning(
                "the engine did not stop within %.0f s (stuck in a collective: a tensor-parallel "
                "rank stopped?); its ranks are ended and its thread left",
                self._stop_timeout_s,
            )
            await in_daemon_thread(self.core.runner.abandon)

    async def _stop_steps(self) -> None:
        await self.loop_engine.stop()
        if self.core.layer_streams is not None:  # (the engine thread no longer touches them)
            self.core.layer_streams.close()
        if self.core.host_tier is not None:  # its copies taken in, its threads and store client
            await in_daemon_thread(self.core.host_tier.close)  # ended (bounded: a few seconds)
        # The steps are over: a tensor-parallel engine's other ranks may go.
        await in_daemon_thread(self.core.runner.close)

    # ------------------------------------------------------------------ requests

    async def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, salt: str | None
    ) -> None:
        await self.loop_engine.call(self.core.add_request, request_id, prompt, params, salt)
        self.loop_engine.notify()

    async def add_transferred(
        self,
        request_id: str,
        prompt: list[int],
        first_token: int,
        params: SamplingParams,
        salt: str | None,
    ) -> None:
        await self.loop_engine.call(
            self.core.add_transferred, request_id, prompt, first_token, params, salt
        )
        self.loop_engine.notify()

    async def abort(self, request_id: str) -> None:
        await self.loop_engine.abort(request_id)
        # Its stream (if any) is failed by the abort; a tx_stream_wait under way holds it.
        self._streams.pop(request_id, None)

    async def end_request(self, request_id: str) -> bool:
        self.core.abort_soon(request_id)
        return await self.loop_engine.call_to_end(_end_request, self.core, request_id)

    # ------------------------------------------------------------------ KV blocks

    async def reserve(
        self, request_id: str, block_hashes: list[BlockHash], prompt_len: int
    ) -> Reserved | None:
        return await self.loop_engine.call_to_end(
            self.port.reserve, request_id, block_hashes, prompt_len
        )

    async def register(self, request_id: str, block_hashes: list[BlockHash]) -> None:
        await self.loop_engine.call_to_end(self.port.register, request_id, block_hashes)

    async def free(self, request_id: str) -> None:
        await self.loop_engine.call_to_end(self.port.free, request_id)

    async def holds(self, request_id: str) -> bool:
        return await self.loop_engine.call(self.port.holds, request_id)

    async def count_cached(self, block_hashes: list[BlockHash]) -> int:
        return await self.loop_engine.call(self.port.count_cached, block_hashes)

    async def adopt(self, block_hashes: list[BlockHash], blocks_data: list[bytes]) -> int:
        return await self.loop_engine.call(self.port.adopt, block_hashes, blocks_data)

    async def pin(self, block_hashes: list[BlockHash]) -> Pinned:
        blocks = await self.loop_engine.acquire(self.port.pin, self.port.unpin, block_hashes)
        pin_id = next(self._ids)
        self._pins[pin_id] = blocks
        return Pinned(pin_id, [b.block_id for b in blocks])

    async def unpin(self, pin_id: int) -> None:
        blocks = self._pins.pop(pin_id, None)
        if blocks is not None:
            await self.loop_engine.call_to_end(self.port.unpin, blocks)

    async def read(self, block_ids: list[int]) -> bytes:
        return await self.loop_engine.call(self.port.read, block_ids)

    async def read_tier(self, block_hashes: list[BlockHash]) -> list[bytes]:
        return await self.loop_engine.call(self.port.read_tier, block_hashes)

    async def block_ids(self, request_id: str) -> list[int]:
        return await self.loop_engine.call(self.port.block_ids, request_id)

    async def take_events(self) -> list[KVCacheEvent]:
        return await self.loop_engine.call(self.port.take_events)

    async def cache_snapshot(self) -> list[BlockStored]:
        return await self.loop_engine.call(self.port.cache_snapshot)

    # ------------------------------------------------------------------ figures

    async def figures(self) -> EngineFigures:
        return self.last_figures()

    def last_figures(self) -> EngineFigures:
        return engine_figures(self.core, self.loop_engine.counters())

    # ------------------------------------------------------------------ transfer sides

    async def open_kv(self, spec: KVSpec) -> KVSides:
        if self._sides:
            raise RuntimeError("the transfer sides are open already")
        self.kv = await asyncio.to_thread(self._open_kv, spec)
        return self.kv

    def _open_kv(self, spec: KVSpec) -> KVSides:
        from splitserve.transfer import (
            KVSecurity,
            KVTls,
            fetch_paths,
            open_receiver,
            open_sender,
        )

        tls = None
        if spec.tls_cert and spec.tls_key and spec.tls_ca:
            tls = KVTls(spec.tls_cert, spec.tls_key, spec.tls_ca)
        security = KVSecurity(
            tls=tls, trust_network=spec.trust_network, rendezvous_key=spec.rendezvous_key
        )
        pool = self.port.kv_pool
        runner, ranks = self.core.runner, None
        if runner.tp.size > 1:
            # A block of a tensor-parallel engine spans every rank's pool: dist moves it rank
            # to rank (transfer.shards, its other ranks told through ``_command_ranks``), the
            # byte path through rank 0 (the runner's whole-heads reads and writes). ipc, tcp and
            # nixl move one pool tensor: not opened.
            ranks = RankLink(runner.tp.size, runner.config.num_kv_heads, self._command_ranks)
            dropped = [p for p in spec.paths if p not in TP_PATHS]
            if dropped:
                logger.info(
                    "KV transfer at tensor parallel size %d: dist rank to rank and gRPC bytes "
                    "(not %s)",
                    runner.tp.size,
                    ",".join(dropped),
                )
                spec = dataclasses.replace(
                    spec, paths=tuple(p for p in spec.paths if p in TP_PATHS)
                )
        life = uuid.uuid4().hex[:8]  # a new id per process life (see the node servers)
        if spec.role == "decode":
            # Always a receiver: gRPC bytes go through its reservations too.
            rx = open_receiver(
                pool,
                f"{spec.address}#{life}",
                paths=spec.paths,
                host=spec.host,
                security=security,
                ranks=ranks,
            )
            self._sides[RX] = rx
            endpoint = rx.endpoint().to_bytes() if rx.paths else b""
            return KVSides(rx_id=rx.node_id, rx_paths=rx.paths, rx_endpoint=endpoint)
        sides: dict[str, Any] = {}
        if len(spec.paths) > 1:  # a path besides gRPC bytes
            tx = open_sender(pool, spec.address, paths=spec.paths, security=security, ranks=ranks)
            self._sides[TX] = tx
            layered = tx.layered_paths if spec.stream_layers else ()
            sides.update(tx_id=tx.node_id, tx_paths=tx.paths, tx_layered=layered)
            if layered:
                self.core.layer_streams = LayerStreams(
                    tx, pool.shape[1], self.port.block_size, pool.device.type == "cuda"
                )
        fetch = fetch_paths(spec.paths)
        if fetch:
            # Serving peers' fetches: a sender of its own over the fetch paths only (the asker
            # names the receiver); their blocks come in through the receiver.
            fetch_tx = open_sender(pool, spec.address, paths=fetch, security=security)
            rx = open_receiver(
                pool,
                f"{spec.address}{FETCH_RECEIVER_MARK}{life}",
                paths=fetch,
                host=spec.host,
                security=security,
            )
            self._sides[FETCH_TX], self._sides[RX] = fetch_tx, rx
            sides.update(
                fetch_paths=fetch_tx.paths,
                fetch_endpoint=fetch_tx.endpoint().to_bytes(),
                rx_id=rx.node_id,
                rx_paths=rx.paths,
                rx_endpoint=rx.endpoint().to_bytes(),
            )
        return KVSides(**sides)

    def _command_ranks(self, payload: bytes, wait: bool) -> None:
        """``RankLink.command``: a message for the other ranks' KV transfer agents, sent on the
        engine thread between steps (the rank channel's messages are in step with the steps);
        with ``wait``, return once it is sent. From a transfer thread, never the engine's."""
        future = self.loop_engine.submit_threadsafe(self.core.runner.send_shards, payload)
        if wait:
            try:
                future.result(timeout=RANK_COMMAND_TIMEOUT_S)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError) as exc:
                from splitserve.transfer import TransferError

                raise TransferError(
                    "the engine's other ranks could not be told (stopping?)"
                ) from exc

    def _side(self, side: str) -> Any:
        part = self._sides.get(side)
        if part is None:
            raise ValueError(f"this engine has no {side} transfer side open")
        return part

    def _reservation(self, res_id: int) -> Any:
        res = self._reservations.get(res_id)
        if res is None:
            raise ValueError(f"no transfer reservation {res_id} here")
        return res

    async def rx_reserve(self, side: str, peer_id: str, block_ids: list[int], path: str) -> ResInfo:
        res = self._side(side).reserve(peer_id, block_ids, path)
        res_id = next(self._ids)
        self._reservations[res_id] = res
        return ResInfo(
            res_id=res_id,
            path=res.path,
            caller_writes=res.caller_writes,
            receive_first=res.receive_first,
            ticket=b"" if res.caller_writes else res.ticket.to_bytes(),
            # (whole-heads blocks: at tensor parallel size > 1 more than this rank's pool holds)
            nbytes=len(res.block_ids) * self.port.block_nbytes,
            num_blocks=len(res.block_ids),
        )

    async def rx_write(self, side: str, res_id: int, block_ids: list[int], data: bytes) -> None:
        # On the engine thread, between steps, like every other write into the pool.
        rx, res = self._side(side), self._reservation(res_id)
        # Under tensor parallelism a block spans every rank's pool: the runner writes it.
        writer = self.port.write if self.core.runner.tp.size > 1 else None
        await self.loop_engine.call(rx.write, res, block_ids, data, writer)

    async def rx_receive(self, side: str, res_id: int, timeout: float) -> None:
        rx, res = self._side(side), self._reservation(res_id)
        await asyncio.to_thread(rx.receive, res, timeout)

    async def rx_finish(self, side: str, res_id: int, count: int | None = None) -> None:
        rx, res = self._side(side), self._reservation(res_id)
        rx.finish(res, count)
        self._reservations.pop(res_id, None)

    async def rx_cancel(self, side: str, res_id: int) -> float:
        res = self._reservations.pop(res_id, None)
        if res is None or side not in self._sides:
            return 0.0
        # In a thread: a tensor-parallel dist receive holds its reservation until every rank
        # wrote (transfer.shards), and the cancel waits for that, not the event loop. Seen
        # through to the end whatever cancels the caller (the blocks are freed after it).
        cancel = asyncio.ensure_future(asyncio.to_thread(self._sides[side].cancel, res))
        return await settle(cancel)

    async def tx_connect(self, side: str, endpoint: bytes) -> str:
        tx = self._side(side)
        return await asyncio.to_thread(tx.connect, endpoint)

    async def tx_close(self, side: str, peer_id: str) -> None:
        tx = self._side(side)
        await asyncio.to_thread(tx.close, peer_id)

    async def tx_send(
        self, side: str, ticket: bytes, src_block_ids: list[int], timeout: float
    ) -> int:
        tx = self._side(side)
        send = functools.partial(tx.send, ticket, src_block_ids, timeout=timeout)
        return await settle(asyncio.get_running_loop().run_in_executor(None, send))

    async def tx_stream_open(
        self, side: str, ticket: bytes, request_id: str, block_index: list[int], timeout: float
    ) -> None:
        if side != TX or self.core.layer_streams is None:
            raise ValueError(f"this engine streams no KV on its {side} side")
        self._streams[request_id] = await self.loop_engine.call(
            self.core.open_stream, request_id, ticket, block_index, timeout
        )

    async def tx_stream_wait(self, side: str, request_id: str) -> int:
        future = self._streams.get(request_id) if side == TX else None
        if future is None:
            raise ValueError(f"no KV stream of request {request_id} on the {side} side")
        try:
            return await settle(asyncio.wrap_future(future))
        finally:
            if future.done():
                self._streams.pop(request_id, None)


async def in_daemon_thread(fn: Any) -> None:
    """``fn()`` on a daemon thread, awaited by polling: one that never returns (a collective
    that never completes) holds no executor thread that the event loop's shutdown, or the
    interpreter's exit, would wait on."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=getattr(fn, "__name__", "stop"), daemon=True)
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.01)
    if errors:
        raise errors[0]


def engine_figures(core: LLMEngine, counters: dict[str, float] | None = None) -> EngineFigures:
    """The figures of a live engine, read without an engine job from the event loop or the
    metrics thread (the reads ``engine.kv_port`` allows there); ``counters``: the engine
    thread's (``AsyncEngine.counters``)."""
    port = core.kv_port
    pool = port.stats()
    slots = port.slot_usage()
    return EngineFigures(
        running=len(core.running) + len(core.scheduler.loading),
        waiting=len(core.waiting) + len(core.ready),
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        prefill_tokens_waiting=core.pending_prefill_tokens,
        kv_tokens_held=slots.tokens_held,
        kv_token_slots=slots.token_slots,
        num_requests=len(core.requests),
        counters={"preemptions": core.num_preemptions, **port.prefix_stats(), **(counters or {})},
        tier_block_load_s=port.tier_block_load_s(),
    )


def _end_request(core: LLMEngine, request_id: str) -> bool:
    """Engine thread. ``abort`` frees a running request's blocks; a request whose
    ``add_transferred`` never ran still holds its adopted blocks under its id: free those too."""
    running = request_id in core.requests
    core.abort(request_id)
    core.kv_port.free(request_id)
    return running


__all__ = ["FETCH_RECEIVER_MARK", "LocalEngine", "StepOutput", "engine_figures"]
