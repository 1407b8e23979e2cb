"""PrefillNode servicer: computes prompts' KV (batched with other prompts under the token budget,
reusing cached prefix blocks), samples the first token, and ships the full blocks by hash plus the
partial tail block into the chosen decode node — only the blocks that node lacks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import grpc

from kernels.layout import gather_blocks
from kvstore import ModelIdentity
from kvstore.codec import batch_indices, encode_blocks
from models.engine import RequestDoesNotFit, StepOutput
from models.engine_loop import AsyncEngine
from proto import nodes_pb2, nodes_pb2_grpc
from splitserve.protocol import sampling_from_proto
from splitserve.serving import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)


class _ShipError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class PrefillService(nodes_pb2_grpc.PrefillNodeServicer):
    def __init__(self, engine: AsyncEngine, identity: ModelIdentity, deadline_s: float) -> None:
        self.engine = engine
        self.identity = identity
        self.root = identity.root_hash
        self.block_size = identity.block_size
        pool = engine.engine.runner.kv_pool
        self.block_nbytes = pool[0].numel() * pool.element_size()
        self.deadline_s = deadline_s
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.counters: Counter[str] = Counter()

    def _stub(self, address: str) -> nodes_pb2_grpc.DecodeNodeStub:
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS
            )
        return nodes_pb2_grpc.DecodeNodeStub(channel)

    async def Prefill(self, request, context):
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
        queue = self.engine.subscribe(rid)
        shipped = False
        try:
            try:
                req = await self.engine.call(core.add_request, rid, prompt, params, salt)
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
            self.counters["prefills"] += 1
            self.counters["prompt_tokens"] += len(prompt)
            self.counters["cached_tokens"] += req.num_cached_tokens
            response = nodes_pb2.PrefillResponse(
                first_token_id=out.new_token_id,
                first_logprob=out.logprob or 0.0,
                finish_reason=out.finish_reason or "",
                cached_tokens=req.num_cached_tokens,
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

    async def _ship(self, request, req, first_token: int, response, context) -> None:
        """Ship the prompt's KV into the decode node; fills the transfer figures of response."""
        hashes = list(req.block_hashes[: len(req.prompt_token_ids) // self.block_size])
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
        )
        block_ids = self.engine.engine.kv.get_block_ids(req.request_id)
        has_tail = len(req.prompt_token_ids) % self.block_size != 0
        outbox: asyncio.Queue = asyncio.Queue()
        outbox.put_nowait(nodes_pb2.TransferMessage(header=header))

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
            runs = [(run, False) for run in batch_indices(missing, self.block_nbytes)]
            if has_tail:
                runs.append(([-1], True))
            for run, tail in runs:
                ids = [block_ids[len(hashes)]] if tail else [block_ids[i] for i in run]
                data = await self.engine.call(self._read_blocks, ids)
                meta, data = await asyncio.to_thread(encode_blocks, run, data, tail)
                nbytes += len(data)
                outbox.put_nowait(
                    nodes_pb2.TransferMessage(blocks=nodes_pb2.BlockData(meta=meta, data=data))
                )
            outbox.put_nowait(nodes_pb2.TransferMessage(end=nodes_pb2.TransferEnd()))
            outbox.put_nowait(None)
            reply = await call.read()
            if reply is grpc.aio.EOF or not reply.done:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.INTERNAL, None, None, "decode node did not confirm the transfer"
                )
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            self.counters["transfers_failed"] += 1
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                msg = f"decode node {request.decode_address} unreachable: {exc.details()}"
            else:
                msg = f"decode node {request.decode_address}: {exc.details()}"
            await context.abort(code, msg)
        except BaseException:
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

    def _read_blocks(self, block_ids: list[int]) -> bytes:
        """Engine thread: the blocks' bytes, over all layers, in order."""
        import torch

        pool = self.engine.engine.runner.kv_pool
        data = gather_blocks(pool, torch.tensor(block_ids, device=pool.device))
        return data.view(torch.uint8).cpu().numpy().tobytes()

    async def GetStats(self, request, context):
        engine = self.engine.engine
        return nodes_pb2.NodeStats(
            role="prefill",
            num_blocks=engine.pool.num_blocks - 1,
            num_free_blocks=engine.pool.num_free_blocks,
            num_cached_blocks=engine.pool.num_cached_blocks,
            running=len(engine.running),
            waiting=len(engine.waiting),
            counters={**self.counters, **_prefix_counters(engine), "steps": self.engine.steps},
        )


def _prefix_counters(engine) -> dict[str, float]:
    stats = engine.kv.stats
    return {
        "prefix_queries": stats.requests,
        "prefix_queried_tokens": stats.queried_tokens,
        "prefix_hit_tokens": stats.hit_tokens,
    }
