"""PrefillNode servicer: computes prompts' KV (batched with other prompts under the token budget,
reusing cached prefix blocks), samples the first token, and ships the full blocks by hash plus the
partial tail block into the chosen decode node — only the blocks that node lacks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter

import grpc

from splitserve.kernels.layout import read_blocks_bytes, write_blocks_bytes
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.kvstore.codec import batch_indices, decode_blocks, encode_blocks
from splitserve.models.engine import RequestDoesNotFit, StepOutput
from splitserve.models.engine_loop import AsyncEngine
from splitserve.runtime.metrics import LoadFigures
from splitserve.runtime.node import node_stats
from splitserve.runtime.protocol import sampling_from_proto
from splitserve.runtime.server import CHANNEL_OPTIONS
from splitserve.transfer import GRPC, Endpoint
from splitserve.transfer import TransferError as TransferLayerError
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)

MIN_FETCH_BLOCKS = 2  # fewer than this: computing is cheaper than a round trip to a peer
# Until measured here: the gRPC block stream moved 0.21-0.24 GB/s on an H200 host
# (benchmarks/transfer.py), and a GPU prefill runs at ~300 TFLOP/s (2 FLOPs/parameter/token).
FETCH_RATE_PRIOR = 0.25e9  # bytes/s
GPU_PREFILL_FLOPS_PRIOR = 300e12
FETCH_LATENCY_S = 0.002  # a round trip and the adoption, whatever the size
RATE_SAMPLE_MIN_TOKENS = 256  # smaller prefills say more about overheads than about speed


def worth_fetching(
    num_blocks: int,
    block_nbytes: int,
    block_size: int,
    fetch_rate: float,
    compute_rate: float | None,
) -> bool:
    """Fetching ``num_blocks`` from a peer beats computing their tokens here, by the estimated
    times (``fetch_rate`` bytes/s; ``compute_rate`` prefill tokens/s, None: unknown → fetch)."""
    if num_blocks < MIN_FETCH_BLOCKS:
        return False
    if compute_rate is None:
        return True
    fetch_s = FETCH_LATENCY_S + num_blocks * block_nbytes / fetch_rate
    return fetch_s < num_blocks * block_size / compute_rate


def _ema(old: float | None, sample: float, weight: float = 0.5) -> float:
    return sample if old is None else (1 - weight) * old + weight * sample


FETCH_TIMEOUT_S = 10.0
ENDPOINT_TTL_S = 60.0  # how long a decode node's transfer endpoint is trusted without a look-up
CONNECT_WAIT_S = 2.0  # a request waits this long for a transfer path to be set up


class _ShipError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class PrefillService(nodes_pb2_grpc.PrefillNodeServiceServicer):
    def __init__(
        self, engine: AsyncEngine, identity: ModelIdentity, deadline_s: float, sender=None
    ) -> None:
        self.engine = engine
        self.identity = identity
        self.root = identity.root_hash
        self.block_size = identity.block_size
        pool = engine.engine.runner.kv_pool
        self.block_nbytes = pool[0].numel() * pool.element_size()
        self.deadline_s = deadline_s
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.counters: Counter[str] = Counter()
        self._fetching: dict[bytes, asyncio.Future] = {}  # last hash of a run → its fetch
        # Fetch or compute a peer's prefix: by measured rates (priors until measured).
        self.fetch_rate = FETCH_RATE_PRIOR
        runner = engine.engine.runner
        self.compute_rate: float | None = None
        if runner.device.type == "cuda":
            params = sum(p.numel() for p in runner.model.parameters())
            self.compute_rate = GPU_PREFILL_FLOPS_PRIOR / (2 * params)
        # KV transfer layer (transfer.KVSender): ipc/dist paths to decode nodes that offer them.
        self.sender = sender
        # decode address → (transfer path or "", its receiver id, when resolved)
        self._routes: dict[str, tuple[str, str, float]] = {}
        self.draining = False  # set on SIGTERM: new prefills are refused, in-flight ones finish
        self._active = 0  # Prefill calls in flight
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ life cycle

    def background(self) -> list:
        return []

    async def drain(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the Prefill calls in flight to finish."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            logger.warning(
                "drain: %d prefills still in flight after %.0f s", self._active, timeout_s
            )

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        if self.sender is not None:
            await asyncio.to_thread(self.sender.close_all)

    def load(self) -> LoadFigures:
        return LoadFigures.of_engine(self.engine.engine)

    def all_counters(self) -> dict[str, float]:
        return {**self.counters, **_prefix_counters(self.engine.engine), "steps": self.engine.steps}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS
            )
        return channel

    def _stub(self, address: str) -> nodes_pb2_grpc.DecodeNodeServiceStub:
        return nodes_pb2_grpc.DecodeNodeServiceStub(self._channel(address))

    async def Prefill(self, request, context):
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "prefill node is draining; retry on another node"
            )
        self._active += 1
        self._idle.clear()
        try:
            return await self._prefill(request, context)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def _prefill(self, request, context):
        rid = request.request_id
        core = self.engine.engine
        try:
            if not rid:
                raise ValueError("request_id is empty")
            params = sampling_from_proto(request.sampling)
            prompt = core.check_prompt(request.prompt_token_ids)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.decode_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address is empty")
        salt = request.cache_salt or None
        fetched = 0
        if request.peer_address and request.peer_blocks:
            fetched = await self._fetch_from_peer(request, prompt, salt, context)
        queue = self.engine.subscribe(rid)
        shipped = False
        try:
            try:
                req = await self.engine.call(core.add_request, rid, prompt, params, salt)
                started = time.perf_counter()
            except ValueError as exc:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
            self.engine.notify()
            out = await queue.get()
            if isinstance(out, BaseException):
                code = (
                    grpc.StatusCode.RESOURCE_EXHAUSTED
                    if isinstance(out, RequestDoesNotFit)
                    else grpc.StatusCode.INTERNAL
                )
                await context.abort(code, str(out))
            assert isinstance(out, StepOutput)
            computed = len(prompt) - req.num_cached_tokens
            if computed >= RATE_SAMPLE_MIN_TOKENS:  # queueing counts too: a cautious estimate
                sample = computed / max(time.perf_counter() - started, 1e-6)
                self.compute_rate = _ema(self.compute_rate, sample)
            self.counters["prefills"] += 1
            self.counters["prompt_tokens"] += len(prompt)
            self.counters["cached_tokens"] += req.num_cached_tokens
            response = nodes_pb2.PrefillResponse(
                first_token_id=out.new_token_id,
                first_logprob=out.logprob or 0.0,
                finish_reason=out.finish_reason or "",
                cached_tokens=req.num_cached_tokens,
                blocks_fetched=fetched,
            )
            if out.finish_reason is None:
                await self._ship(request, req, out.new_token_id, response, context)
                shipped = True
            return response
        finally:
            self.engine.unsubscribe(rid)
            if not shipped:
                self.counters["prefills_not_shipped"] += 1
            # The blocks stay cached here as prefix for later prompts (LRU).
            await self.engine.call(core.abort, rid)

    async def _transfer_path(self, decode_address: str) -> tuple[str, str]:
        """(path, receiver id) to ``decode_address`` through the transfer layer: ("", "") for
        the gRPC byte stream. Resolved once and kept ENDPOINT_TTL_S (a node restarted at the
        same address may offer more), so shipping itself only looks it up."""
        if self.sender is None:
            return "", ""
        cached = self._routes.get(decode_address)
        if cached is not None and time.monotonic() - cached[2] < ENDPOINT_TTL_S:
            return cached[0], cached[1]
        route = await self._resolve_route(decode_address)
        if route is None:
            return "", ""
        self._routes[decode_address] = (*route, time.monotonic())
        return route

    async def _resolve_route(self, decode_address: str) -> tuple[str, str] | None:
        """Look up the decode node's transfer endpoint and set up the path to it; ``None``: not
        settled yet (no answer, or the path still being set up): ship bytes, try next time."""
        try:
            stats = await nodes_pb2_grpc.NodeStatsServiceStub(
                self._channel(decode_address)
            ).GetStats(nodes_pb2.GetStatsRequest(), timeout=5.0)
        except grpc.aio.AioRpcError:
            return None
        if not stats.transfer_endpoint:
            return "", ""
        try:
            # Setting up a pair can take long (dist: a rendezvous); the request does not wait
            # for it past CONNECT_WAIT_S: it ships as gRPC bytes, the setup completes meanwhile.
            path = await asyncio.wait_for(
                asyncio.shield(asyncio.to_thread(self.sender.connect, stats.transfer_endpoint)),
                CONNECT_WAIT_S,
            )
        except TimeoutError:
            return None
        except Exception as exc:
            logger.warning("kv transfer to %s: %s; sending gRPC bytes", decode_address, exc)
            return "", ""
        if path == GRPC:
            return "", ""
        return path, Endpoint.from_bytes(stats.transfer_endpoint).node_id

    async def _send_through_layer(self, ticket: bytes, src: list[int], timeout: float) -> int:
        """Move the blocks with the transfer layer; the copy is never left running behind a
        closed stream (ipc writes straight into the decode node's blocks)."""
        sending = asyncio.ensure_future(
            asyncio.to_thread(self.sender.send, ticket, src, timeout=timeout)
        )
        try:
            return await asyncio.shield(sending)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await sending
            raise

    async def _ship(self, request, req, first_token: int, response, context) -> None:
        """Ship the prompt's KV into the decode node; fills the transfer figures of response."""
        hashes = list(req.block_hashes[: len(req.prompt_token_ids) // self.block_size])
        path, receiver_id = await self._transfer_path(request.decode_address)
        header = nodes_pb2.TransferHeader(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            first_token_id=first_token,
            block_hashes=hashes,
            model_root_hash=self.root,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            block_nbytes=self.block_nbytes,
            deadline_s=self.deadline_s,
            sender_id=self.sender.node_id if self.sender is not None else "",
            transfer_path=path,
            receiver_id=receiver_id,
        )
        block_ids = self.engine.engine.kv.get_block_ids(req.request_id)
        has_tail = len(req.prompt_token_ids) % self.block_size != 0
        outbox: asyncio.Queue = asyncio.Queue()
        outbox.put_nowait(nodes_pb2.TransferKVRequest(header=header))

        async def messages():
            while (msg := await outbox.get()) is not None:
                yield msg

        timeout = context.time_remaining()
        call = self._stub(request.decode_address).TransferKV(messages(), timeout=timeout)
        t0 = time.perf_counter()
        nbytes = 0
        try:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, None, None, "decode node closed the transfer"
                )
            missing = list(reply.missing)
            if reply.ticket:
                src = [block_ids[i] for i in missing]
                if has_tail:
                    src.append(block_ids[len(hashes)])
                try:
                    nbytes = await self._send_through_layer(
                        reply.ticket, src, timeout or self.deadline_s
                    )
                except (TransferLayerError, ValueError) as exc:
                    self._routes.pop(request.decode_address, None)
                    raise _ShipError(
                        grpc.StatusCode.UNAVAILABLE, f"{path} transfer failed: {exc}"
                    ) from None
                self.counters[f"transfers_{path}"] += 1
                runs = []
            else:
                if path:  # the decode node declined (it restarted?): look it up afresh next time
                    self._routes.pop(request.decode_address, None)
                runs = [(run, False) for run in batch_indices(missing, self.block_nbytes)]
                if has_tail:
                    runs.append(([-1], True))
            for run, tail in runs:
                ids = [block_ids[len(hashes)]] if tail else [block_ids[i] for i in run]
                data = await self.engine.call(self._read_blocks, ids)
                meta, data = await asyncio.to_thread(encode_blocks, run, data, tail)
                nbytes += len(data)
                outbox.put_nowait(
                    nodes_pb2.TransferKVRequest(blocks=nodes_pb2.BlockData(meta=meta, data=data))
                )
            outbox.put_nowait(nodes_pb2.TransferKVRequest(end=nodes_pb2.TransferEnd()))
            outbox.put_nowait(None)
            reply = await call.read()
            if reply is grpc.aio.EOF or not reply.done:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.INTERNAL, None, None, "decode node did not confirm the transfer"
                )
        except (grpc.aio.AioRpcError, _ShipError) as exc:
            outbox.put_nowait(None)  # end the request stream before cancelling the call
            call.cancel()
            self.counters["transfers_failed"] += 1
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                msg = f"decode node {request.decode_address} unreachable: {exc.details()}"
            else:
                msg = f"decode node {request.decode_address}: {exc.details()}"
            await context.abort(code, msg)
        except BaseException:
            outbox.put_nowait(None)
            call.cancel()
            raise
        shipped_blocks = len(missing)
        response.blocks_shipped = shipped_blocks
        response.blocks_reused = len(hashes) - shipped_blocks
        response.bytes_shipped = nbytes
        self.counters["blocks_shipped"] += shipped_blocks
        self.counters["blocks_reused_on_decode"] += len(hashes) - shipped_blocks
        self.counters["bytes_shipped"] += nbytes
        self.counters["transfer_seconds"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ peer prefix reuse

    async def _fetch_from_peer(self, request, prompt: list[int], salt, context) -> int:
        """Fetch the prompt's prefix blocks a peer holds (per the router's index hint) instead
        of computing them; returns how many were adopted. Any failure: 0, and the prompt is
        simply computed (never a wrong answer: the blocks are addressed by chained hash)."""
        hashes = hash_request_tokens(prompt, self.block_size, self.root, salt)
        # The last prompt token is always computed (its logits), as in get_computed_blocks.
        hashes = hashes[: min(request.peer_blocks, (len(prompt) - 1) // self.block_size)]
        if not hashes:
            return 0
        # NOTE: single flight: concurrent prompts with one prefix wait for the first fetch of it
        # (then find the blocks cached here) instead of each fetching the same blocks.
        key = hashes[-1]
        while (pending := self._fetching.get(key)) is not None:
            await asyncio.shield(pending)
        done = asyncio.get_running_loop().create_future()
        self._fetching[key] = done
        try:
            return await self._fetch_missing(request, hashes, context)
        finally:
            del self._fetching[key]
            done.set_result(None)

    async def _fetch_missing(self, request, hashes: list[bytes], context) -> int:
        local = await self.engine.call(self._count_cached, hashes)
        want = hashes[local:]
        if not worth_fetching(
            len(want), self.block_nbytes, self.block_size, self.fetch_rate, self.compute_rate
        ):
            if len(want) >= MIN_FETCH_BLOCKS:
                self.counters["prefix_fetch_skipped_slower"] += 1
            return 0
        t0 = time.perf_counter()
        got: dict[int, bytes] = {}
        try:
            call = self._peer_stub(request.peer_address).FetchBlocks(
                nodes_pb2.FetchBlocksRequest(
                    block_hashes=want, model_root_hash=self.root, block_nbytes=self.block_nbytes
                ),
                timeout=min(FETCH_TIMEOUT_S, context.time_remaining() or FETCH_TIMEOUT_S),
            )
            async for msg in call:
                batch = await asyncio.to_thread(
                    decode_blocks, msg.meta, msg.data, self.block_nbytes
                )
                for j, index in enumerate(batch.indices):
                    if not 0 <= index < len(want):
                        raise ValueError(f"peer sent block index {index}")
                    got[index] = batch.data[j * self.block_nbytes : (j + 1) * self.block_nbytes]
        except (grpc.aio.AioRpcError, ValueError) as exc:
            self.counters["prefix_fetch_failed"] += 1
            logger.warning(
                "prefix fetch from %s failed, computing instead: %s", request.peer_address, exc
            )
            return 0
        n = 0
        while n in got:
            n += 1
        if n == 0:
            return 0
        adopted = await self.engine.call(self._adopt_fetched, want[:n], [got[i] for i in range(n)])
        if n * self.block_nbytes >= 1 << 20:  # big enough to say something about the rate
            sample = n * self.block_nbytes / max(time.perf_counter() - t0 - FETCH_LATENCY_S, 1e-6)
            self.fetch_rate = _ema(self.fetch_rate, sample)
        self.counters["prefix_blocks_fetched"] += adopted
        return adopted

    def _count_cached(self, hashes: list[bytes]) -> int:
        pool = self.engine.engine.pool
        n = 0
        while n < len(hashes) and pool.get_cached_block(hashes[n]) is not None:
            n += 1
        return n

    def _adopt_fetched(self, hashes: list[bytes], blocks_data: list[bytes]) -> int:
        """Engine thread: write fetched blocks into this pool and register them as cached."""
        kv = self.engine.engine.kv
        tmp = f"fetch-{uuid.uuid4().hex}"
        to_write = kv.adopt_blocks(tmp, hashes)
        if to_write is None:
            return 0
        try:
            new_ids = {id(b) for b in to_write}
            rows = [i for i, b in enumerate(kv.req_to_blocks[tmp]) if id(b) in new_ids]
            if rows:
                write_blocks_bytes(
                    self.engine.engine.runner.kv_pool,
                    [kv.req_to_blocks[tmp][i].block_id for i in rows],
                    b"".join(blocks_data[i] for i in rows),
                )
            kv.cache_blocks(tmp, hashes, len(hashes) * self.block_size)
        finally:
            kv.free(tmp)  # the blocks stay cached (LRU) for the request about to be scheduled
        return len(hashes)

    def _peer_stub(self, address: str) -> nodes_pb2_grpc.PrefillNodeServiceStub:
        return nodes_pb2_grpc.PrefillNodeServiceStub(self._channel(address))

    async def FetchBlocks(self, request, context):
        if request.model_root_hash != self.root or request.block_nbytes != self.block_nbytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "model identity or block size differs from this node's",
            )
        hashes = list(request.block_hashes)
        pinned = await self.engine.call(self._pin, hashes)
        try:
            for run in batch_indices(list(range(len(pinned))), self.block_nbytes):
                data = await self.engine.call(self._read_blocks, [pinned[i].block_id for i in run])
                meta, data = await asyncio.to_thread(encode_blocks, run, data)
                yield nodes_pb2.BlockData(meta=meta, data=data)
            self.counters["blocks_served_to_peers"] += len(pinned)
        finally:
            await self.engine.call(self.engine.engine.pool.free_blocks, pinned)

    def _pin(self, hashes: list[bytes]) -> list:
        """Engine thread: touch the longest leading run of ``hashes`` held here."""
        pool = self.engine.engine.pool
        blocks = []
        for block_hash in hashes:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        pool.touch(blocks)
        return blocks

    def _read_blocks(self, block_ids: list[int]) -> bytes:
        """Engine thread: the blocks' bytes, over all layers, in order."""
        return read_blocks_bytes(self.engine.engine.runner.kv_pool, block_ids)

    async def GetStats(self, request, context):
        engine = self.engine.engine
        return node_stats("prefill", engine, self.identity, self.load(), self.all_counters())


def _prefix_counters(engine) -> dict[str, float]:
    stats = engine.kv.stats
    return {
        "prefix_queries": stats.requests,
        "prefix_queried_tokens": stats.queried_tokens,
        "prefix_hit_tokens": stats.hit_tokens,
    }
