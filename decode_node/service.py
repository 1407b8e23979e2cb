"""DecodeNode servicer: adopts shipped KV blocks, then decodes with continuous batching.

A transfer reserves blocks first (cached hashes are touched, the others allocated), stages the
incoming bytes, and writes and registers them only once every message checked out; a transfer that
fails or is abandoned frees its reservation. The adopted request then waits (up to its deadline)
for the router's ``Decode`` call, which joins it to the running batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from splitserve.kernels.layout import write_blocks_bytes
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.kvstore.codec import decode_blocks
from splitserve.models.engine import StepOutput
from splitserve.models.engine_loop import AsyncEngine
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime.metrics import LoadFigures
from splitserve.runtime.node import node_stats
from splitserve.runtime.protocol import sampling_from_proto
from splitserve.transfer import TransferError as TransferLayerError
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    """A request whose KV is adopted, waiting for ``Decode``."""

    prompt: list[int]
    first_token: int
    params: SamplingParams
    cache_salt: str | None
    deadline: float


RESERVE_WAIT_S = 30.0  # a transfer waits this long for blocks held by other requests to free
# An ipc transfer that ended without the sender's TransferEnd: its blocks may still be the target
# of a copy the sender's GPU has queued; they are freed only after this long.
IPC_FREE_GRACE_S = 10.0


class TransferError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DecodeService(nodes_pb2_grpc.DecodeNodeServiceServicer):
    def __init__(
        self, engine: AsyncEngine, identity: ModelIdentity, deadline_s: float, receiver=None
    ) -> None:
        self.engine = engine
        self.identity = identity
        self.root = identity.root_hash
        self.block_size = identity.block_size
        pool = engine.engine.runner.kv_pool
        self.block_nbytes = pool[0].numel() * pool.element_size()
        self.deadline_s = deadline_s
        self.pending: dict[str, Pending] = {}
        self.counters: Counter[str] = Counter()
        self._freed = asyncio.Condition()  # notified whenever this node frees a request's blocks
        # Block hashes whose data an in-flight transfer is receiving → done when it ends. A
        # transfer of the same prefix waits for it and then reuses the blocks, rather than
        # having the same bytes shipped again (a burst of prompts with a new shared prefix).
        self._receiving: dict[bytes, asyncio.Future] = {}
        self._in_transfer: set[str] = set()  # request ids with a TransferKV call in progress
        self._background: set[asyncio.Task] = set()
        # KV transfer layer (transfer.KVReceiver): the ipc/dist paths this node offers senders.
        self.receiver = receiver
        self._endpoint = receiver.endpoint().to_bytes() if receiver is not None else b""
        self.draining = False  # set on SIGTERM: new transfers are refused, accepted ones finish
        self._transfers = 0  # TransferKV calls in flight

    # ------------------------------------------------------------------ life cycle

    def background(self) -> list:
        return [self.expire_pending()]

    async def drain(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until every accepted request is done: transfers in flight,
        transferred requests waiting for their Decode call, and requests decoding."""
        deadline = time.monotonic() + timeout_s
        engine = self.engine.engine
        while self._transfers or self.pending or engine.requests:
            if time.monotonic() >= deadline:
                logger.warning(
                    "drain: %d transfers, %d pending, %d decoding after %.0f s",
                    self._transfers,
                    len(self.pending),
                    len(engine.requests),
                    timeout_s,
                )
                return
            async with self._freed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), 0.1)

    async def close(self) -> None:
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.shutdown)

    def load(self) -> LoadFigures:
        return LoadFigures.of_engine(self.engine.engine, pending_transfers=len(self.pending))

    def all_counters(self) -> dict[str, float]:
        engine = self.engine.engine
        return {
            **self.counters,
            "preemptions": engine.num_preemptions,
            "steps": self.engine.steps,
        }

    # ------------------------------------------------------------------ transfer

    async def TransferKV(self, request_iterator, context):
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "decode node is draining; ship to another node"
            )
        self._transfers += 1
        try:
            async with contextlib.aclosing(self._transfer(request_iterator, context)) as replies:
                async for reply in replies:
                    yield reply
        finally:
            self._transfers -= 1
            await self._notify_freed()

    async def _transfer(self, request_iterator, context):
        rid = None
        reserved = False
        receiving = asyncio.get_running_loop().create_future()
        claimed: list[bytes] = []
        res = None  # the transfer layer's reservation, when the blocks come through it
        owner = False
        try:
            first = await anext(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise TransferError(
                    grpc.StatusCode.INVALID_ARGUMENT, "a transfer starts with a TransferHeader"
                )
            header = first.header
            rid = header.request_id
            params, prompt = self._check_header(header)
            self._in_transfer.add(rid)  # no await since the checks: the id is this transfer's
            owner = True
            hashes = list(header.block_hashes)
            await self._wait_for_receiving(hashes, context)
            reserved = True  # from here on the request id's blocks are this transfer's to free
            missing, has_tail, dest = await self._reserve_waiting(rid, hashes, len(prompt), context)
            for i in missing:
                if hashes[i] not in self._receiving:
                    self._receiving[hashes[i]] = receiving
                    claimed.append(hashes[i])
            res = self._reserve_in_layer(header, dest)
            yield nodes_pb2.TransferKVResponse(
                missing=missing, ticket=res.ticket.to_bytes() if res is not None else b""
            )
            if res is None:
                staged = await self._receive(request_iterator, set(missing), has_tail)
                await self.engine.call(
                    self._commit, rid, list(header.block_hashes), len(prompt), missing, staged
                )
                nbytes = sum(len(d) for d in staged.values())
            else:
                await self._receive_through_layer(res, request_iterator, context)
                await self.engine.call(self._register, rid, hashes)
                nbytes = len(res.block_ids) * self.block_nbytes
                self.counters[f"transfers_{res.path}"] += 1
            reused = len(header.block_hashes) - len(missing)
            self.pending[rid] = Pending(
                prompt,
                header.first_token_id,
                params,
                header.cache_salt or None,
                time.monotonic() + (header.deadline_s or self.deadline_s),
            )
            self.counters["transfers"] += 1
            self.counters["blocks_adopted"] += len(missing)
            self.counters["blocks_reused"] += reused
            self.counters["bytes_received"] += nbytes
            yield nodes_pb2.TransferKVResponse(done=True, blocks_reused=reused)
        except TransferError as exc:
            self.counters["transfers_failed"] += 1
            if reserved:
                await self._release_failed(rid, res)
            await context.abort(exc.code, str(exc))
        except BaseException:
            # Client gone or cancelled: nothing half-written is ever registered; free the rest.
            self.counters["transfers_failed"] += 1
            if reserved and rid not in self.pending:
                await self._release_failed(rid, res)
            raise
        finally:
            if owner:
                self._in_transfer.discard(rid)
            for block_hash in claimed:
                del self._receiving[block_hash]
            receiving.set_result(None)

    async def _wait_for_receiving(self, hashes: list[bytes], context) -> None:
        """Wait until no other transfer is receiving any of ``hashes`` (bounded by the
        caller's deadline); they are then cached here (or, if that transfer failed, missing
        and shipped by this one)."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        waited = False
        while pending := {self._receiving[h] for h in hashes if h in self._receiving}:
            if not waited:
                self.counters["transfers_waited_for_same_blocks"] += 1
                waited = True
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
            await asyncio.wait(pending, timeout=timeout)
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "deadline passed waiting for another transfer of the same blocks",
                )

    def _reserve_in_layer(self, header, dest: list[int]):
        """For a sender that asked for the ipc/dist path to this very node: reserve the
        destination blocks ``dest`` in the transfer layer (its ticket goes back in the reply).
        ``None``: the blocks come as BlockData on this stream."""
        if self.receiver is None or not header.transfer_path:
            return None
        if header.receiver_id != self.receiver.node_id:
            self.counters["transfers_declined_stale_endpoint"] += 1
            return None
        try:
            return self.receiver.reserve(header.sender_id, dest, header.transfer_path)
        except (TransferLayerError, ValueError) as exc:
            logger.info(
                "%s transfer from %s declined: %s", header.transfer_path, header.sender_id, exc
            )
            return None

    async def _receive_through_layer(self, res, request_iterator, context) -> None:
        """Wait for the sender's data (dist: until it is in the pool; ipc: the sender copies,
        then sends TransferEnd), then mark the reservation complete. On any failure the
        reservation is cancelled: nothing of it is ever registered."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        try:
            if res.path == "dist":
                remaining = context.time_remaining() or self.deadline_s
                try:
                    await asyncio.to_thread(self.receiver.receive, res, remaining)
                except TransferLayerError as exc:
                    raise TransferError(
                        grpc.StatusCode.UNAVAILABLE, f"dist transfer: {exc}"
                    ) from None
            end = await anext(request_iterator, None)
            if end is None or end.WhichOneof("kind") != "end":
                raise TransferError(bad, f"expected TransferEnd after the {res.path} transfer")
            if res.path != "dist":
                self.receiver.complete(res)
        except BaseException:
            self.receiver.cancel(res)
            raise

    def _register(self, rid: str, hashes: list[bytes]) -> None:
        """Engine thread: the layer wrote the blocks; register their hashes."""
        self.engine.engine.kv.cache_blocks(rid, hashes, len(hashes) * self.block_size)

    async def _release_failed(self, rid: str, res) -> None:
        """Free a failed transfer's blocks. Its layer reservation is cancelled first, so no later
        data lands in them; an ipc reservation the sender never finished keeps its blocks for
        IPC_FREE_GRACE_S (the sender's GPU may still have a copy into them queued)."""
        if res is not None and not res.ended:
            self.receiver.cancel(res)
            if res.path == "ipc":
                self.counters["ipc_blocks_quarantined"] += len(res.block_ids)

                async def free_later() -> None:
                    await asyncio.sleep(IPC_FREE_GRACE_S)
                    await self._free(rid)

                task = asyncio.create_task(free_later())
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                return
        await self._free(rid)

    async def _free(self, rid: str) -> None:
        await self.engine.call(self.engine.engine.kv.free, rid)
        await self._notify_freed()

    async def _notify_freed(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    async def _reserve_waiting(self, rid: str, hashes: list[bytes], prompt_len: int, context):
        """Reserve the transfer's blocks; while the pool is short only because other requests
        hold blocks (a burst), wait for them to free — up to RESERVE_WAIT_S and the caller's
        deadline — rather than fail work the prefill node has already done."""
        need = len(hashes) + (prompt_len % self.block_size != 0)
        usable = self.engine.engine.pool.num_blocks - 1
        if need > usable:
            raise TransferError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the prompt needs {need} KV blocks, this decode node has {usable} in all",
            )
        remaining = context.time_remaining()
        wait_s = RESERVE_WAIT_S if remaining is None else min(RESERVE_WAIT_S, remaining)
        deadline = time.monotonic() + wait_s
        waited = False
        while True:
            try:
                # Shielded: the engine thread finishes an allocation it has started even if this
                # call is cancelled; the caller then frees it (the id is this transfer's).
                result = await asyncio.shield(
                    self.engine.call(self._reserve, rid, hashes, prompt_len)
                )
            except TransferError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if not waited:
                    self.counters["transfers_waited_for_blocks"] += 1
                    waited = True
                # Requests finishing on the engine thread free blocks too: look again soon.
                async with self._freed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._freed.wait(), min(left, 0.05))
                continue
            return result

    def _check_header(self, header) -> tuple[SamplingParams, list[int]]:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not header.request_id:
            raise TransferError(bad, "request_id is empty")
        rid = header.request_id
        # Also refused: an id being transferred, or whose blocks are still held (an unfinished
        # ipc transfer's blocks wait IPC_FREE_GRACE_S before they are freed).
        if (
            rid in self.pending
            or rid in self.engine.engine.requests
            or rid in self._in_transfer
            or rid in self.engine.engine.kv.req_to_blocks
        ):
            raise TransferError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {header.request_id!r} is already on this node",
            )
        if header.model_root_hash != self.root:
            raise TransferError(
                bad,
                f"model identity mismatch: this decode node serves "
                f"{self.identity}; the sender computed a different root hash",
            )
        if header.block_nbytes != self.block_nbytes:
            raise TransferError(bad, f"block_nbytes {header.block_nbytes} != {self.block_nbytes}")
        try:
            params = sampling_from_proto(header.sampling)
            prompt = self.engine.engine.check_prompt(header.prompt_token_ids)
        except ValueError as exc:
            raise TransferError(bad, str(exc)) from None
        vocab = self.engine.engine.runner.config.vocab_size
        if header.first_token_id >= vocab:
            raise TransferError(bad, f"first_token_id {header.first_token_id} >= vocab {vocab}")
        # A peer's hashes are a claim, not a fact: they must be the chain of these tokens.
        expected = hash_request_tokens(
            prompt, self.block_size, self.root, header.cache_salt or None
        )
        if list(header.block_hashes) != expected:
            raise TransferError(bad, "block_hashes do not match the prompt's chained hashes")
        return params, prompt

    def _reserve(
        self, rid: str, hashes: list[bytes], prompt_len: int
    ) -> tuple[list[int], bool, list[int]]:
        """Engine thread: touch cached hashes, allocate the rest and the tail block. Returns the
        indices of the hashes whose data must come, whether a tail block comes, and the block ids
        that data goes to (missing blocks in order, then the tail)."""
        kv = self.engine.engine.kv
        to_write = kv.adopt_blocks(rid, hashes)
        if to_write is None or kv.allocate_slots(rid, prompt_len) is None:
            kv.free(rid)
            raise TransferError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode node is out of KV blocks (waited up to {RESERVE_WAIT_S:.0f} s for "
                "other requests to free some); retry on another node",
            )
        blocks = kv.req_to_blocks[rid]
        new_ids = {id(b) for b in to_write}
        missing = [i for i, b in enumerate(blocks[: len(hashes)]) if id(b) in new_ids]
        has_tail = prompt_len % self.block_size != 0
        dest = [blocks[i].block_id for i in missing]
        if has_tail:
            dest.append(blocks[len(hashes)].block_id)
        return missing, has_tail, dest

    async def _receive(self, request_iterator, missing: set[int], has_tail: bool):
        bad = grpc.StatusCode.INVALID_ARGUMENT
        staged: dict[int, bytes] = {}  # index (-1: tail) → one block's bytes
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "end":
                break
            if kind != "blocks":
                raise TransferError(bad, f"unexpected {kind} message in a transfer")
            try:
                # Checksumming MBs is CPU work: off the event loop (zlib releases the GIL).
                batch = await asyncio.to_thread(
                    decode_blocks, msg.blocks.meta, msg.blocks.data, self.block_nbytes
                )
            except ValueError as exc:
                raise TransferError(bad, str(exc)) from None
            wanted = {-1} if batch.tail else missing
            for j, index in enumerate(batch.indices):
                if index not in wanted or index in staged:
                    raise TransferError(bad, f"block index {index} was not asked for")
                staged[index] = batch.data[j * self.block_nbytes : (j + 1) * self.block_nbytes]
        else:
            raise TransferError(bad, "transfer ended without a TransferEnd")
        expected = missing | ({-1} if has_tail else set())
        if set(staged) != expected:
            raise TransferError(
                bad, f"transfer incomplete: {len(expected - set(staged))} blocks missing"
            )
        return staged

    def _commit(
        self,
        rid: str,
        hashes: list[bytes],
        prompt_len: int,
        missing: list[int],
        staged: dict[int, bytes],
    ) -> None:
        """Engine thread: write the staged blocks, then make the full ones findable."""
        kv = self.engine.engine.kv
        pool = self.engine.engine.runner.kv_pool
        blocks = kv.req_to_blocks[rid]
        order = [*missing, *([-1] if -1 in staged else [])]
        if order:
            ids = [blocks[i].block_id if i >= 0 else blocks[len(hashes)].block_id for i in order]
            write_blocks_bytes(pool, ids, b"".join(staged[i] for i in order))
        kv.cache_blocks(rid, hashes, len(hashes) * self.block_size)

    # ------------------------------------------------------------------ decode

    async def Decode(self, request, context):
        rid = request.request_id
        pending = self.pending.pop(rid, None)
        if pending is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"request {rid!r} has no transferred KV here (never sent, or its deadline passed)",
            )
        queue = self.engine.subscribe(rid)
        try:
            try:
                await self.engine.call(
                    self.engine.engine.add_transferred,
                    rid,
                    pending.prompt,
                    pending.first_token,
                    pending.params,
                    pending.cache_salt,
                )
            except RuntimeError as exc:
                await self._free(rid)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            self.engine.notify()
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    await context.abort(grpc.StatusCode.INTERNAL, f"decoding failed: {out}")
                assert isinstance(out, StepOutput)
                yield nodes_pb2.DecodeResponse(
                    token_ids=[out.new_token_id],
                    logprobs=[out.logprob] if out.logprob is not None else [],
                    finish_reason=out.finish_reason or "",
                )
                if out.finish_reason is not None:
                    self.counters["requests_finished"] += 1
                    return
        finally:
            self.engine.unsubscribe(rid)
            if rid in self.engine.engine.requests:  # cancelled or failed mid-stream
                self.counters["requests_aborted"] += 1
                await self.engine.call(self.engine.engine.abort, rid)
            await self._notify_freed()

    async def expire_pending(self) -> None:
        """Free transferred requests whose Decode call never came (router died, client gone)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rid in [r for r, p in self.pending.items() if p.deadline < now]:
                del self.pending[rid]
                self.counters["transfers_expired"] += 1
                await self._free(rid)

    async def GetStats(self, request, context):
        return node_stats(
            "decode",
            self.engine.engine,
            self.identity,
            self.load(),
            self.all_counters(),
            transfer_endpoint=self._endpoint,
        )
