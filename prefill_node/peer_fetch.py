"""Peer prefix reuse: fetch a prompt's prefix blocks from a peer prefill node that holds them
(per the router's index hint) instead of computing them, and serve ``FetchBlocks`` to peers.

Blocks are addressed by chained hash, so a stale hint or a dead peer never gives a wrong answer:
whatever is not fetched is computed. The engine's blocks are reached through its
``engine.api.NodeEngine`` commands only (count_cached, adopt, pin/unpin, read).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from splitserve.engine.api import NodeEngine
from splitserve.kvstore import BlockHash, hash_request_tokens
from splitserve.prefill_node.channels import Channels
from splitserve.prefill_node.peer_layer import LayerFetch
from splitserve.prefill_node.rates import MIN_FETCH_BLOCKS, Rates
from splitserve.runtime import counter_names as names
from splitserve.runtime.auth import call_metadata
from splitserve.transfer import batch_indices, decode_blocks, encode_blocks
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)

# A fetch saves computing the prefix, so it may not cost the request much more than computing
# would: it gets FETCH_BUDGET_X times the blocks' compute time at the node's measured prefill
# rate, at least FETCH_MIN_S (a round trip through two engines' step boundaries under load) and
# at most FETCH_TIMEOUT_S (also the budget while that rate is unknown), never past the request's
# deadline. Past it the request computes: a stalled holder, and every prompt of the same prefix
# waiting on its one fetch, once waited FETCH_TIMEOUT_S (10 s: two tenants on one H100 saw TTFT
# p99 of 5-12 s from it).
FETCH_TIMEOUT_S = 10.0
FETCH_MIN_S = 1.0
FETCH_BUDGET_X = 4.0
# A peer a fetch timed out on is not asked again for this long (its prompts are computed): what
# stalled it may stall the next fetch too.
PEER_BACKOFF_S = 10.0
MAX_FETCH_BLOCKS = 1 << 16  # what one FetchBlocks may name (a 1M-token prompt of 16-token blocks)
MAX_BACKOFF_PEERS = 1024  # peers held in the back-off map before the expired ones are dropped


class PeerFetcher:
    def __init__(
        self,
        engine: NodeEngine,
        root_hash: bytes,
        rates: Rates,
        channels: Channels,
        counters: Counter[str],
        layer: LayerFetch | None = None,
    ) -> None:
        self.layer = layer  # fetches through the transfer layer where a path exists
        self.engine = engine
        self.root = root_hash
        self.block_size, self.block_nbytes = engine.info.block_size, engine.info.block_nbytes
        self.rates, self.channels, self.counters = rates, channels, counters
        self._fetching: dict[bytes, asyncio.Future] = {}  # last hash of a run → its fetch
        self._backoff: dict[str, float] = {}  # peer → until when it is not asked (monotonic)

    # ------------------------------------------------------------------ client

    async def fetch(
        self,
        peer: str,
        peer_blocks: int,
        prompt: list[int],
        salt: str | None,
        timeout: float | None,
    ) -> int:
        """Fetch the prompt's prefix blocks ``peer`` holds (up to ``peer_blocks``) into the
        prefix cache; returns how many were adopted. Any failure, or the fetch outlasting its
        budget (``budget_s``, or ``timeout``: the request's time left, if less): 0, and the
        prompt is simply computed. Only a fetch that ran its whole budget itself backs its
        holder off."""
        hashes = hash_request_tokens(prompt, self.block_size, self.root, salt)
        # The last prompt token is always computed (its logits), as in get_computed_blocks.
        hashes = hashes[: min(peer_blocks, (len(prompt) - 1) // self.block_size)]
        if not hashes:
            return 0
        if self._skipped(peer):
            return 0
        own = self.budget_s(len(hashes))
        loop = asyncio.get_running_loop()
        began = loop.time()

        def left() -> float | None:  # of the request's own time (None: no deadline)
            return None if timeout is None else timeout - (loop.time() - began)

        # NOTE: single flight: concurrent prompts with one prefix wait for the first fetch of it
        # (then find the blocks cached here) instead of each fetching the same blocks. That
        # fetch ends within its own budget; a waiter's own deadline may end the wait sooner.
        key = hashes[-1]
        while (pending := self._fetching.get(key)) is not None:
            try:
                async with asyncio.timeout(left()):
                    blamed = await asyncio.shield(pending)
            except TimeoutError:
                return 0  # its deadline passed while it waited: it fails there, not here
            if blamed == peer:  # that fetch outlasted its budget at this very holder
                self.counters[names.PREFIX_FETCH_SKIPPED_PEER_SLOW] += 1
                return 0
        if self._skipped(peer):
            return 0
        rest = left()
        budget = own if rest is None else min(own, rest)
        if budget <= 0:
            return 0
        done: asyncio.Future[str | None] = loop.create_future()
        self._fetching[key] = done
        blamed = None
        try:
            # Everything the fetch does waits within the budget: the route look-up, the engines
            # and the holder. Cancelling it is safe: each step frees what it reserved to its
            # end (peer_layer, engine.adopt), so the budget may run over by that clean-up.
            async with asyncio.timeout(budget) as limit:
                return await self._fetch_missing(peer, hashes, prompt, salt, budget)
        except TimeoutError:
            if not limit.expired():
                raise  # not the budget's (a transfer's own timeout): as any other failure
            self.counters[names.PREFIX_FETCH_TIMED_OUT] += 1
            if budget < own:
                return 0  # the request's own deadline came first: no fault of the holder's
            blamed = peer
            self._back_off(peer)
            logger.warning(
                "prefix fetch from %s took over its %.2f s budget: computing instead, and not "
                "asking it again for %.0f s",
                peer,
                budget,
                PEER_BACKOFF_S,
            )
            return 0
        finally:
            del self._fetching[key]
            done.set_result(blamed)  # the waiters: whether the holder timed out

    def budget_s(self, num_blocks: int) -> float:
        """How long fetching ``num_blocks`` may take (see FETCH_BUDGET_X), before the request's
        own deadline is counted."""
        compute_s = self.rates.compute_seconds(num_blocks)
        budget = FETCH_TIMEOUT_S if compute_s is None else FETCH_BUDGET_X * compute_s
        return min(max(budget, FETCH_MIN_S), FETCH_TIMEOUT_S)

    def _skipped(self, peer: str) -> bool:
        """``peer`` is being left alone (a fetch from it timed out lately): counted."""
        if self._backoff.get(peer, 0.0) > time.monotonic():
            self.counters[names.PREFIX_FETCH_SKIPPED_PEER_SLOW] += 1
            return True
        return False

    def _back_off(self, peer: str) -> None:
        now = time.monotonic()
        self._backoff[peer] = now + PEER_BACKOFF_S
        if len(self._backoff) > MAX_BACKOFF_PEERS:  # drop the expired ones (peers gone)
            self._backoff = {p: t for p, t in self._backoff.items() if t > now}

    async def _fetch_missing(
        self,
        peer: str,
        hashes: list[BlockHash],
        prompt: list[int],
        salt: str | None,
        timeout: float,
    ) -> int:
        local = await self.engine.count_cached(hashes)
        want = hashes[local:]
        # What the peer recomputes the asked hashes from: no prompt, no blocks.
        proof = dict(
            prompt_token_ids=prompt[: len(hashes) * self.block_size],
            cache_salt=salt or "",
            first_block=local,
        )
        layer = self.layer
        path = await layer.path_to(peer) if layer is not None else None
        if not self.rates.worth_fetching(len(want), path or ""):
            if len(want) >= MIN_FETCH_BLOCKS:
                self.counters[names.PREFIX_FETCH_SKIPPED_SLOWER] += 1
            return 0
        t0 = time.perf_counter()
        if layer is not None and path is not None:
            adopted = await layer.fetch(peer, self.root, want, proof, timeout)
            if adopted is not None:  # None: the layer declined; fetch bytes
                if adopted:
                    seconds = time.perf_counter() - t0
                    self.rates.fetched(adopted * self.block_nbytes, seconds, path)
                    self.counters[names.PREFIX_BLOCKS_FETCHED] += adopted
                return adopted
        try:
            got = await self._receive(peer, want, proof, timeout)
        except (grpc.aio.AioRpcError, ValueError) as exc:
            self.counters[names.PREFIX_FETCH_FAILED] += 1
            logger.warning("prefix fetch from %s failed, computing instead: %s", peer, exc)
            return 0
        n = 0
        while n in got:
            n += 1
        if n == 0:
            return 0
        # One engine call reserves, writes, registers and releases: nothing to leak if the
        # caller is cancelled meanwhile.
        adopted = await self.engine.adopt(want[:n], [got[i] for i in range(n)])
        self.rates.fetched(n * self.block_nbytes, time.perf_counter() - t0)
        self.counters[names.PREFIX_BLOCKS_FETCHED] += adopted
        return adopted

    async def _receive(
        self, peer: str, want: list[BlockHash], proof: dict[str, Any], timeout: float
    ) -> dict[int, bytes]:
        """The blocks ``peer`` sends of ``want``, by index."""
        stub = nodes_pb2_grpc.PrefillNodeServiceStub(self.channels.get(peer))
        call = stub.FetchBlocks(
            nodes_pb2.FetchBlocksRequest(
                block_hashes=want,
                model_root_hash=self.root,
                block_nbytes=self.block_nbytes,
                **proof,
            ),
            timeout=timeout,
            metadata=call_metadata(),
        )
        got: dict[int, bytes] = {}
        size = self.block_nbytes
        async for msg in call:
            batch = await asyncio.to_thread(decode_blocks, msg.meta, msg.data, size)
            for j, index in enumerate(batch.indices):
                if not 0 <= index < len(want):
                    raise ValueError(f"peer sent block index {index}")
                got[index] = batch.data[j * size : (j + 1) * size]
        return got

    # ------------------------------------------------------------------ server

    def accepts(self, request: nodes_pb2.FetchBlocksRequest) -> bool:
        """The peer's model identity and block size are this node's."""
        return request.model_root_hash == self.root and request.block_nbytes == self.block_nbytes

    @property
    def max_blocks(self) -> int:
        """The most blocks a prompt of this model can have (what a fetch may name)."""
        max_len = self.engine.info.max_model_len
        return min(MAX_FETCH_BLOCKS, max_len // self.block_size + 1)

    def why_not_proven(self, request: nodes_pb2.FetchBlocksRequest) -> str | None:
        """Why the asker has not shown it knows the prompt of the asked blocks (None: it has):
        the token ids it sent, with its salt, must hash to exactly the asked run."""
        n, first = len(request.block_hashes), request.first_block
        if n == 0 or first + n > self.max_blocks:
            return f"ask for blocks within the first {self.max_blocks} of a prompt"
        if len(request.prompt_token_ids) != (first + n) * self.block_size:
            return "send the token ids of every block up to the last one asked for"
        chain = hash_request_tokens(
            request.prompt_token_ids, self.block_size, self.root, request.cache_salt or None
        )
        if chain[first:] != list(request.block_hashes):
            return "the token ids do not hash to the asked blocks"
        return None

    async def serve(
        self, request: nodes_pb2.FetchBlocksRequest
    ) -> AsyncGenerator[nodes_pb2.FetchBlocksResponse, None]:
        """``FetchBlocks``: the longest leading run of the requested blocks held here, as
        BlockData messages: those in the accelerator pool (pinned while they are read), then,
        from where that run ends, those in the host tier's memory (copied out a batch at a
        time, so a long run does not hold the engine for long); with a ticket, the pool's
        through the transfer layer."""
        hashes = list(map(BlockHash, request.block_hashes))
        # A caller cancelled before the pin is answered has the blocks unpinned for it.
        pinned = await self.engine.pin(hashes)
        try:
            if request.ticket:
                declined = nodes_pb2.FetchBlocksResponse()  # no transfer_path: fetch bytes
                # The layer sends pool blocks only: a run the pool holds only part of may go on
                # in the host tier, which the byte path reads.
                partial = len(pinned.block_ids) < len(hashes) and self.engine.info.host_tier
                yield (
                    await self.layer.serve(request, pinned)
                    if self.layer and not partial
                    else declined
                )
                return
            block_ids = pinned.block_ids
            for run in batch_indices(list(range(len(block_ids))), self.block_nbytes):
                data = await self.engine.read([block_ids[i] for i in run])
                meta, data = await asyncio.to_thread(encode_blocks, run, data)
                yield nodes_pb2.FetchBlocksResponse(meta=meta, data=data)
            self.counters[names.BLOCKS_SERVED_TO_PEERS] += len(block_ids)
            first = len(block_ids)
            rest = list(range(first, len(hashes)))
            for run in batch_indices(rest, self.block_nbytes):
                held = await self.engine.read_tier([hashes[i] for i in run])
                if held:
                    sent = run[: len(held)]
                    meta, data = await asyncio.to_thread(encode_blocks, sent, b"".join(held))
                    yield nodes_pb2.FetchBlocksResponse(meta=meta, data=data)
                    self.counters[names.BLOCKS_SERVED_TO_PEERS] += len(held)
                    self.counters[names.TIER_BLOCKS_SERVED_TO_PEERS] += len(held)
                if len(held) < len(run):  # the tier's run ended (or was evicted meanwhile)
                    break
        finally:
            # To the end: run even if the call is cancelled again meanwhile.
            await self.engine.unpin(pinned.pin_id)
