"""The decode node's receiving side: every transfer, whichever path its bytes take, goes through
one reservation, made by the node's transfer receiver (which lives beside the pool, behind the
engine: ``engine.api.NodeEngine``'s ``rx_*`` commands), of the blocks the engine reserved.

    inbox.begin(header) → transfer.reserve() → transfer.receive() → [transfer.write(BlockData)…]
        → transfer.commit() (finishes, registers) → on any failure or cancel: transfer.release()

Which path a transfer takes is the sender's choice (the header names it) and the layer's
business: this module only acts on what the reservation says of itself. Blocks that come on the
stream (``caller_writes``: gRPC bytes) are checked message by message (the byte path's codec,
``transfer.decode_blocks``) and written through the reservation; otherwise the sender moves
them, and where the layer receives them itself (``receive_first``) ``receive`` waits for that.
Hashes are registered only in ``commit``, once the layer says every block has arrived, so a
failed transfer leaves nothing findable: its blocks are freed (after the grace the layer asks for
when the sender may still have a write into them queued).

Over 300 lines: one transfer's receiving side (reserve, write or wait, commit or free) with its
failure paths, kept together so every release is visible beside what it releases.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from splitserve.decode_node.cleanup import Signal
from splitserve.decode_node.header import TransferRefused, check_header
from splitserve.decode_node.peer_caps import PeerCaps, PeerHold
from splitserve.decode_node.pending import PendingTable
from splitserve.engine.api import RX, NodeEngine, Reserved, ResInfo
from splitserve.engine.loop import settle
from splitserve.kvstore import BlockHash, ModelIdentity
from splitserve.runtime import counter_names as names
from splitserve.runtime.failure import Failure
from splitserve.transfer import Incomplete, decode_blocks
from splitserve.transfer import TransferError as TransferLayerError

if TYPE_CHECKING:
    from splitserve.models.sampling_params import SamplingParams
    from splitserve.v1 import nodes_pb2

logger = logging.getLogger(__name__)

RESERVE_WAIT_S = 30.0  # a transfer waits this long for blocks held by other requests to free
BAD = Failure.INVALID


class KVInbox:
    """What the transfers of one decode node share: the engine (its blocks and its transfer
    receiver), which block hashes are being received, which request ids are in transfer or in
    the engine."""

    def __init__(
        self,
        engine: NodeEngine,
        identity: ModelIdentity,
        pending: PendingTable,
        counters: Counter[str],
        caps: PeerCaps | None = None,
    ) -> None:
        self.engine = engine
        self.rx_id = engine.kv.rx_id  # the receiver's id: a sender's ticket names it
        self.identity = identity
        self.pending = pending
        self.counters = counters
        self.caps = caps  # what each sending node may hold here (None: no per-peer caps)
        self.freed = Signal()  # notified whenever this node frees a request's blocks
        # Block hashes whose data an in-flight transfer is receiving → done when it ends. A
        # transfer of the same prefix waits for it and then reuses the blocks, rather than
        # having the same bytes shipped again (a burst of prompts with a new shared prefix).
        self.receiving: dict[bytes, asyncio.Future] = {}
        self.in_transfer: set[str] = set()  # request ids with a TransferKV call in progress
        # Request ids a relay stream's decode or generate command added to the engine and has not
        # ended yet (added just before the engine is asked, dropped once it has ended the
        # request): the node's own table, never the engine's, which lives on its thread (or in
        # its process).
        self.live: set[str] = set()
        self._quarantined: set[asyncio.Task] = set()
        # Senders look a path up only if this node offers one besides the gRPC bytes (the
        # engine's receiver gives no endpoint otherwise).
        self.endpoint = engine.kv.rx_endpoint

    def begin(self, header: nodes_pb2.TransferHeader, peer: str) -> Transfer:
        """Check ``header``, take the sending node's (``peer``'s) share of its caps and claim
        the request id (``TransferRefused`` otherwise)."""
        info = self.engine.info
        params, prompt = check_header(header, info, self.identity, self.in_use)
        hold = None
        if self.caps is not None:
            num_blocks = len(header.block_hashes) + (len(prompt) % info.block_size != 0)
            hold = self.caps.admit(peer, num_blocks)
        self.in_transfer.add(header.request_id)  # no await since the check: the id is ours
        return Transfer(self, header, params, prompt, hold)

    def in_use(self, rid: str) -> bool:
        """The id is taken here: in transfer, waiting for its decode command, or in the engine."""
        return rid in self.pending or rid in self.live or rid in self.in_transfer

    async def free(self, rid: str) -> None:
        await self.engine.free(rid)  # to the end, even if the caller is cancelled
        self.freed.notify()

    def quarantine(self, rid: str, num_blocks: int, grace_s: float) -> None:
        """Free ``rid``'s blocks only after ``grace_s``: a transfer its sender never finished may
        still have a write into them queued (ipc: a copy on the sender's GPU)."""
        self.counters[names.IPC_BLOCKS_QUARANTINED] += num_blocks

        async def free_later() -> None:
            await asyncio.sleep(grace_s)
            await self.free(rid)

        task = asyncio.create_task(free_later())
        self._quarantined.add(task)
        task.add_done_callback(self._quarantined.discard)

    async def wait_for_receiving(self, hashes: Sequence[bytes], deadline: float | None) -> None:
        """Wait until no other transfer is receiving any of ``hashes``; they are then cached
        here (or, if that transfer failed, missing and shipped by this one)."""
        waited = False
        while pending := {self.receiving[h] for h in hashes if h in self.receiving}:
            if not waited:
                self.counters[names.TRANSFERS_WAITED_FOR_SAME_BLOCKS] += 1
                waited = True
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
            await asyncio.wait(pending, timeout=timeout)
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferRefused(
                    Failure.DEADLINE,
                    "deadline passed waiting for another transfer of the same blocks",
                )

    async def reserve_blocks(
        self, rid: str, hashes: list[BlockHash], prompt_len: int, deadline: float | None
    ) -> Reserved:
        """Reserve the transfer's blocks; while the pool is short only because other requests
        hold blocks (a burst), wait for them to free — up to RESERVE_WAIT_S and the caller's
        deadline — rather than fail work the prefill node has already done."""
        info = self.engine.info
        need = len(hashes) + (prompt_len % info.block_size != 0)
        usable = info.num_usable_blocks
        if need > usable:
            raise TransferRefused(
                Failure.REFUSED,
                f"the prompt needs {need} KV blocks, this decode node has {usable} in all",
            )
        now = time.monotonic()
        wait_s = RESERVE_WAIT_S if deadline is None else min(RESERVE_WAIT_S, deadline - now)
        give_up = now + wait_s
        waited = False
        while True:
            # To the end even if cancelled: the caller's release then frees what it allocated.
            reserved = await self.engine.reserve(rid, hashes, prompt_len)
            if reserved is not None:
                return reserved
            left = give_up - time.monotonic()
            if left <= 0:
                raise TransferRefused(
                    Failure.REFUSED,
                    f"decode node is out of KV blocks (waited up to {RESERVE_WAIT_S:.0f} s for "
                    "other requests to free some); retry on another node",
                )
            if not waited:
                self.counters[names.TRANSFERS_WAITED_FOR_BLOCKS] += 1
                waited = True
            # Requests finishing on the engine thread free blocks too: look again soon.
            await self.freed.wait(min(left, 0.05))

    async def reserve_in_layer(self, header: nodes_pb2.TransferHeader, dest: list[int]) -> ResInfo:
        """The layer's reservation of ``dest``: over the path the sender asked for when it asked
        this very node and the path can be served, else for the blocks as BlockData ("")."""
        path = header.transfer_path  # "": BlockData on the stream
        if path and header.receiver_id != self.rx_id:
            self.counters[names.TRANSFERS_DECLINED_STALE_ENDPOINT] += 1
        elif path:
            try:
                return await self.engine.rx_reserve(RX, header.sender_id, dest, path)
            except (TransferLayerError, ValueError) as exc:
                logger.info("%s transfer from %s declined: %s", path, header.sender_id, exc)
        return await self.engine.rx_reserve(RX, header.sender_id, dest, "")

    async def close(self) -> None:
        """Nothing to shut down: the receiver is the engine's (``NodeEngine.stop`` closes it)."""


class Transfer:
    """One TransferKV call's hold on this node; ``release`` undoes whatever it still holds."""

    def __init__(
        self,
        inbox: KVInbox,
        header: nodes_pb2.TransferHeader,
        params: SamplingParams,
        prompt: list[int],
        hold: PeerHold | None = None,
    ) -> None:
        self.inbox = inbox
        self.hold = hold  # its sender's share of the per-peer caps, given back by release
        self.header = header
        self.rid: str = header.request_id
        self.params = params
        self.prompt = prompt
        self.hashes = cast(list[BlockHash], list(header.block_hashes))  # checked: check_header
        self.missing: list[int] = []
        self.res: ResInfo | None = None  # the layer's reservation, where the engine lives
        self.adopted = False  # registered and handed to the pending table: not ours to free
        self._dest: dict[int, int] = {}  # grpc: block index (-1: tail) → reserved block id
        self._received: set[int] = set()
        self._claimed: list[bytes] = []
        loop = asyncio.get_running_loop()
        self._receiving = loop.create_future()  # done when this transfer ends
        self._reserving = loop.create_future()  # done when its reservation is made (or it ends)
        self._owns_blocks = False
        self._released = False

    @property
    def streamed(self) -> bool:
        """Its sender ships each layer while its prefill runs (the first token comes at the
        end): the reservation is made before anything is computed."""
        return self.header.first_token_at_end

    @property
    def path(self) -> str:
        """The transfer path's name ("" before the reservation is made), for counts and logs."""
        return self.res.path if self.res is not None else ""

    @property
    def on_stream(self) -> bool:
        """The blocks come as BlockData on this call's stream (else the sender moves them)."""
        return self.res is None or self.res.caller_writes

    @property
    def ticket(self) -> bytes:
        """For the sender: empty when the blocks come as BlockData on the stream."""
        return b"" if self.res is None or self.on_stream else self.res.ticket

    @property
    def nbytes(self) -> int:
        """The bytes of the blocks it reserved (and, once committed, received)."""
        return self.res.nbytes if self.res is not None else 0

    def _reservation(self) -> ResInfo:
        assert self.res is not None, "the transfer has no reservation yet"
        return self.res

    async def reserve(self, time_remaining: float | None) -> None:
        inbox = self.inbox
        # Blocks still held under the id: an unfinished ipc transfer's, freed after the grace.
        if await inbox.engine.holds(self.rid):
            raise TransferRefused(
                Failure.ALREADY_EXISTS, f"request {self.rid!r} is already on this node"
            )
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        if self.streamed:
            # Reserved before its prefill runs: waiting here for another transfer of the same
            # prefix would serialise same-prefix prefills (a streamed one ends only with its
            # prefill), and a claim would make the next ones wait on it the same way. It
            # reserves its own copy of blocks in flight elsewhere; the first registered keeps
            # the hash, the other copy is recycled unhashed (BlockPool.cache_full_blocks).
            await self._reserve_blocks(deadline)
            return
        await inbox.wait_for_receiving(self.hashes, deadline)
        # NOTE: claimed before the reservation's awaits, not after: a transfer of the same prefix
        # arriving meanwhile must wait for this one rather than reserve a second copy of the
        # blocks (the router's KV ledger counts a shared block once). Claimed for the
        # reservation only (``_reserving``): once it says which hashes were cached here, those
        # are given back at once and only the ones to be written stay claimed until the data
        # is in (``_receiving``), so a transfer sharing only cached blocks waits for no data.
        for block_hash in self.hashes:
            if block_hash not in inbox.receiving:
                inbox.receiving[block_hash] = self._reserving
                self._claimed.append(block_hash)
        await self._reserve_blocks(deadline)

    async def _reserve_blocks(self, deadline: float | None) -> None:
        inbox = self.inbox
        self._owns_blocks = True  # from here on the id's blocks are this transfer's to free
        reserved = await inbox.reserve_blocks(self.rid, self.hashes, len(self.prompt), deadline)
        if self._released:  # released meanwhile (its claims are gone): free what was reserved
            await inbox.free(self.rid)
            raise TransferRefused(Failure.CANCELLED, "transfer ended while reserving")
        self.missing = reserved.missing
        to_write = {self.hashes[i] for i in self.missing}
        for block_hash in self._claimed:
            if block_hash in to_write:
                inbox.receiving[block_hash] = self._receiving
            else:
                del inbox.receiving[block_hash]
        self._claimed = [h for h in self._claimed if h in to_write]
        self._reserving.set_result(None)
        indices = [*self.missing, *([-1] if reserved.has_tail else [])]
        self._dest = dict(zip(indices, reserved.dest, strict=True))
        await settle(asyncio.ensure_future(self._reserve_in_layer(reserved.dest)))

    async def _reserve_in_layer(self, dest: list[int]) -> None:
        """Kept even when the call is cancelled meanwhile (``settle``): ``release`` then
        cancels the reservation rather than leave it behind where the engine lives."""
        self.res = await self.inbox.reserve_in_layer(self.header, dest)

    async def write(self, meta: bytes, data: bytes) -> None:
        """Check one BlockData message and write its blocks into the reservation."""
        res = self._reservation()
        if not res.caller_writes:
            raise TransferRefused(BAD, f"expected TransferEnd after the {res.path} transfer")
        block_nbytes = self.inbox.engine.info.block_nbytes
        try:
            # Checksumming MBs is CPU work: off the event loop (zlib releases the GIL).
            batch = await asyncio.to_thread(decode_blocks, meta, data, block_nbytes)
        except ValueError as exc:
            raise TransferRefused(BAD, str(exc)) from None
        wanted = {-1} if batch.tail else set(self.missing)
        ids = []
        for index in batch.indices:
            if index not in wanted or index not in self._dest or index in self._received:
                raise TransferRefused(BAD, f"block index {index} was not asked for")
            self._received.add(index)
            ids.append(self._dest[index])
        # Where the engine lives, between steps, like every other write into the pool.
        await self.inbox.engine.rx_write(RX, res.res_id, ids, batch.data)

    async def receive(self, timeout: float) -> None:
        """Where the layer takes the data in itself (``receive_first``): until the sender's
        blocks are in the pool; before the sender's TransferEnd, which comes only after."""
        res = self._reservation()
        if not res.receive_first:
            return
        try:
            await self.inbox.engine.rx_receive(RX, res.res_id, timeout)
        except TransferLayerError as exc:
            raise TransferRefused(Failure.UNAVAILABLE, f"{res.path} transfer: {exc}") from None

    async def commit(self) -> None:
        """The sender said it finished: the layer ends the reservation as done (or says which
        blocks did not arrive), then the hashes are registered."""
        res = self._reservation()
        try:
            await self.inbox.engine.rx_finish(RX, res.res_id)
        except Incomplete as exc:
            raise TransferRefused(BAD, str(exc)) from None
        except TransferLayerError as exc:
            raise TransferRefused(Failure.UNAVAILABLE, f"{res.path} transfer: {exc}") from None
        await self.inbox.engine.register(self.rid, self.hashes)
        self.adopted = True

    async def release(self) -> None:
        """Free what this transfer holds unless it was adopted, drop its claims and wake the
        transfers waiting for its blocks. Idempotent; completes even if cancelled meanwhile."""
        if self._released:
            return
        self._released = True
        try:
            if self._owns_blocks and not self.adopted:
                await self._free_blocks()
        except ConnectionError as exc:  # the engine is gone, and the blocks with it
            logger.warning("transfer of %s not released: %s", self.rid, exc)
        finally:
            try:
                for block_hash in self._claimed:
                    del self.inbox.receiving[block_hash]
                self._claimed = []
                for future in (self._reserving, self._receiving):
                    if not future.done():
                        future.set_result(None)
                self.inbox.in_transfer.discard(self.rid)
            finally:
                if self.hold is not None:
                    self.hold.release()  # its sender's share back, whatever ended the transfer

    async def _free_blocks(self) -> None:
        """Cancel the reservation, then free the blocks (after the layer's grace, if it asks for
        one); both happen even when the caller is cancelled meanwhile."""
        res = self.res
        if res is None:
            await self.inbox.free(self.rid)  # to the end
            return
        # First: no later data of the layer lands in the blocks (but a sender writing into this
        # pool itself may still have a write queued: the layer then asks for a grace).
        cancel = asyncio.ensure_future(self.inbox.engine.rx_cancel(RX, res.res_id))
        try:
            await settle(cancel)  # to the end, through cancellations of this task
        finally:
            grace_s = 0.0
            if cancel.done() and not cancel.cancelled() and cancel.exception() is None:
                grace_s = cancel.result()
            if grace_s > 0:
                self.inbox.quarantine(self.rid, res.num_blocks, grace_s)
            else:
                await self.inbox.free(self.rid)
