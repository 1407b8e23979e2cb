"""PrefillNodeService servicer: computes prompts' KV (batched with other prompts under the token
budget, reusing cached prefix blocks), samples the first token, and ships the full blocks by hash
plus the partial tail block into the chosen decode node — only the blocks that node lacks.

The servicer turns protobuf into calls: shipping is ``shipper.KVShipper``, peer prefix reuse
(fetching and serving ``FetchBlocks``) is ``peer_fetch.PeerFetcher``. The engine is reached
through ``engine.api.NodeEngine`` only (in this process or in an engine process of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc

from splitserve.engine.api import EngineFigures, NodeEngine, StepOutput
from splitserve.engine.core import FirstFacts
from splitserve.kvstore import ModelIdentity
from splitserve.models.sampling_params import SamplingParams
from splitserve.prefill_node.channels import Channels
from splitserve.prefill_node.peer_fetch import PeerFetcher
from splitserve.prefill_node.peer_layer import LayerFetch
from splitserve.prefill_node.rates import Rates
from splitserve.prefill_node.shipper import KVShipper, OpenStream, ShipError, Shipped
from splitserve.runtime import counter_names as names
from splitserve.runtime import tracing
from splitserve.runtime.metrics import LoadFigures
from splitserve.runtime.node import checked_request, failure_code, node_stats
from splitserve.runtime.status import to_grpc
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillService(nodes_pb2_grpc.PrefillNodeServiceServicer):
    def __init__(
        self,
        engine: NodeEngine,
        identity: ModelIdentity,
        deadline_s: float,
        stream_min_tokens: int = 0,
    ) -> None:
        """``engine``: started, its transfer sides opened (``open_kv``) if it has any;
        ``stream_min_tokens``: prompts this long ship their KV while it is computed (0: never)."""
        self.engine = engine
        self.identity = identity
        self.counters: Counter[str] = Counter()
        self.channels = Channels()
        # Fetch or compute a peer's prefix: by measured rates (priors until measured).
        self.rates = Rates.for_engine(engine.info)
        self.shipper = KVShipper(
            engine, identity.root_hash, deadline_s, self.channels, self.counters, stream_min_tokens
        )
        # Peer prefix fetches through the transfer layer: this node receives (the engine's
        # receiver), and serves its peers' fetches with a sender of its own (the engine's fetch
        # sender, the fetch paths only).
        layer = LayerFetch(engine, self.channels, self.counters)
        self.fetcher = PeerFetcher(
            engine, identity.root_hash, self.rates, self.channels, self.counters, layer
        )
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
        """The channels to peers; the engine closes its transfer sides itself (``stop``)."""
        await self.channels.close()
        await self.shipper.close()

    def load(self) -> LoadFigures:
        return LoadFigures.of_figures(self.engine.last_figures())

    def all_counters(self) -> dict[str, float]:
        """Read without waiting for the engine (the metrics thread calls this too)."""
        return _all_counters(self.counters, self.engine.last_figures())

    # ------------------------------------------------------------------ Prefill

    async def Prefill(
        self, request: nodes_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.PrefillResponse:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "prefill node is draining; retry on another node"
            )
        self._active += 1
        self._idle.clear()
        trace = tracing.carrier_of(context.invocation_metadata())
        try:
            with tracing.span("prefill_node.Prefill", carrier=trace, server=True) as span:
                if span.is_recording():
                    span.set_attributes(
                        {
                            "splitserve.request_id": request.request_id,
                            "splitserve.prompt_tokens": len(request.prompt_token_ids),
                            "splitserve.decode_node": request.decode_address,
                        }
                    )
                return await self._prefill(request, context)
        except ConnectionError as exc:  # engine.protocol.EngineGone: the node exits next
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill node's engine: {exc}")
            raise  # (abort raised already)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def _prefill(
        self, request: nodes_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.PrefillResponse:
        rid = request.request_id
        try:
            params, prompt = checked_request(self.engine.info, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.decode_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address is empty")
        salt = request.cache_salt or None
        fetched = 0
        if request.peer_address and request.peer_blocks:
            fetched = await self.fetcher.fetch(
                request.peer_address, request.peer_blocks, prompt, salt, context.time_remaining()
            )
        queue = self.engine.subscribe(rid)
        shipped = False
        opened: OpenStream | None = None
        streaming: asyncio.Task[Shipped | None] | None = None
        first: asyncio.Future[tuple[int, list[int]] | None]
        first = asyncio.get_running_loop().create_future()
        opened_at = time.monotonic()
        try:
            if self.shipper.may_stream(len(prompt)):
                # The KV leaves as the forward writes it: the transfer runs under the prefill.
                # The decode node's reservation and the engine's stream come first, so the
                # stream sees every step of the prefill.
                opened = await self._open_stream(request, prompt, context)
                if opened is not None:
                    streaming = asyncio.create_task(self.shipper.finish_stream(opened, rid, first))
            started = await self._add(rid, prompt, params, salt, context)
            out, facts = await self._first(prompt, started, queue, context)
            first_at, first_mono = time.perf_counter(), time.monotonic()
            if tracing.enabled():
                _trace_compute(len(prompt), facts, first_mono - (first_at - started))
            response = nodes_pb2.PrefillResponse(
                first_token_id=out.new_token_id,
                first_logprob=out.logprob or 0.0,
                finish_reason=out.finish_reason or "",
                cached_tokens=facts.num_cached_tokens,
                blocks_fetched=fetched,
                compute_seconds=first_at - started,
            )
            if streaming is not None:
                assert facts.block_ids is not None  # (checked by _first)
                ended = out.finish_reason is not None
                first.set_result(None if ended else (out.new_token_id, facts.block_ids))
                shipped = self._shipped(await self._streamed(streaming, context), response)
            elif out.finish_reason is None:
                await self._ship(request, prompt, out.new_token_id, facts, response, context)
                shipped = True
            if shipped:  # what the transfer added after the first token
                response.transfer_seconds = time.perf_counter() - first_at
                if tracing.enabled():  # a stream ran from before the prefill
                    _trace_transfer(response, opened_at if streaming else first_mono)
            return response
        finally:
            if streaming is not None and not streaming.done():
                # Failed or cancelled before its first token: the stream ends once the request
                # is aborted below (the engine fails it), and its reservation is let go (here
                # too: a task cancelled before it ran never lets it go itself).
                first.cancel()
                streaming.cancel()
                assert opened is not None
                opened.stream.abandon()
            self.engine.unsubscribe(rid)
            if not shipped:
                self.counters[names.PREFILLS_NOT_SHIPPED] += 1
            # The blocks stay cached here as prefix for later prompts (LRU). A request cancelled
            # mid-prefill is not scheduled again: the next step drops it before scheduling
            # (only the step already running computes it), whatever engine calls are queued.
            # The abort is submitted before anything can interrupt it: a handler cancelled
            # again while it waits would otherwise drop it, and the blocks would stay held.
            # (An engine that is gone took the blocks with it: the call's status stands.)
            with contextlib.suppress(ConnectionError):
                await self.engine.abort(rid)
            if streaming is not None and not streaming.done():
                with contextlib.suppress(BaseException):
                    await streaming  # (settles once the engine dropped the stream)

    async def _open_stream(
        self,
        request: nodes_pb2.PrefillRequest,
        prompt: list[int],
        context: grpc.aio.ServicerContext,
    ) -> OpenStream | None:
        """A stream opened for the request (None: it ships after its prefill); a decode node
        that cannot take it ends the call before anything is computed."""
        try:
            return await self.shipper.open_stream(request, prompt, context.time_remaining())
        except ShipError as exc:
            await context.abort(to_grpc(exc.code), exc.message)
            raise  # (abort raised already)

    async def _streamed(
        self, streaming: asyncio.Task[Shipped | None], context: grpc.aio.ServicerContext
    ) -> Shipped | None:
        """The streamed shipment's end (None: nothing to ship); its failure ends the call."""
        try:
            return await streaming
        except ShipError as exc:
            await context.abort(to_grpc(exc.code), exc.message)
            raise  # (abort raised already)

    @staticmethod
    def _shipped(shipped: Shipped | None, response: nodes_pb2.PrefillResponse) -> bool:
        """Fill the transfer figures of ``response``; whether anything was shipped."""
        if shipped is None:
            return False
        response.blocks_shipped = shipped.blocks_shipped
        response.blocks_reused = shipped.blocks_reused
        response.bytes_shipped = shipped.bytes_shipped
        response.transfer_path = shipped.path
        return True

    async def _add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        salt: str | None,
        context: grpc.aio.ServicerContext,
    ) -> float:
        """Add the request to the engine; when it was added (``perf_counter``)."""
        try:
            await self.engine.add_request(rid, prompt, params, salt)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        return time.perf_counter()

    async def _first(
        self,
        prompt: list[int],
        started: float,
        queue: asyncio.Queue[StepOutput | BaseException],
        context: grpc.aio.ServicerContext,
    ) -> tuple[StepOutput, FirstFacts]:
        """Wait for the request's first token: (its output, what that output says of the
        prompt's blocks)."""
        out = await queue.get()
        if isinstance(out, BaseException):
            await context.abort(to_grpc(failure_code(out)), str(out))
        assert isinstance(out, StepOutput)
        facts = out.facts
        if facts is None or facts.block_hashes is None or facts.block_ids is None:
            # A prefill-only engine's first output always brings them.
            await context.abort(
                grpc.StatusCode.INTERNAL, "the engine's first output says nothing of its blocks"
            )
        assert facts is not None
        cached = facts.num_cached_tokens
        self.rates.prefilled(len(prompt) - cached, time.perf_counter() - started)
        self.counters[names.PREFILLS] += 1
        self.counters[names.PROMPT_TOKENS] += len(prompt)
        self.counters[names.CACHED_TOKENS] += cached
        return out, facts

    async def _ship(
        self,
        request: nodes_pb2.PrefillRequest,
        prompt: list[int],
        first_token: int,
        facts: FirstFacts,
        response: nodes_pb2.PrefillResponse,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Ship the prompt's KV (its blocks as ``facts`` names them, checked by ``_first``)
        into the decode node; fills the transfer figures of response."""
        assert facts.block_hashes is not None and facts.block_ids is not None
        try:
            shipped = await self.shipper.ship(
                request,
                prompt,
                facts.block_hashes,
                facts.block_ids,
                first_token,
                context.time_remaining(),
            )
        except ShipError as exc:
            await context.abort(to_grpc(exc.code), exc.message)
        self._shipped(shipped, response)

    # ------------------------------------------------------------------ FetchBlocks, GetStats

    async def FetchBlocks(
        self, request: nodes_pb2.FetchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[nodes_pb2.FetchBlocksResponse]:
        if not self.fetcher.accepts(request):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "model identity or block size differs from this node's",
            )
        # Knowing a prefix's hashes (they are in Redis) is not enough to read its blocks.
        # (Hashing up to a whole context's tokens: off the event loop.)
        if (why := await asyncio.to_thread(self.fetcher.why_not_proven, request)) is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        # aclosing: a cancelled call closes the inner stream at once, which unpins its blocks.
        async with contextlib.aclosing(self.fetcher.serve(request)) as blocks:
            async for msg in blocks:
                yield msg

    async def GetStats(
        self, request: nodes_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.GetStatsResponse:
        figures = await self.engine.figures()
        # What askers choose a fetch path from: the fetch sender's endpoint.
        return node_stats(
            "prefill",
            self.engine.info,
            figures,
            LoadFigures.of_figures(figures),
            _all_counters(self.counters, figures),
            transfer_endpoint=self.engine.kv.fetch_endpoint,
        )


def _trace_compute(prompt_len: int, facts: FirstFacts, added: float) -> None:
    """The request's wait in the engine's queue and its prefill, up to its first token now
    (``added``: when it joined the engine, ``time.monotonic()``)."""
    admitted = added + facts.queued_s
    tracing.record("queue", added, admitted)
    cached = facts.num_cached_tokens
    tracing.record(
        "compute",
        admitted,
        time.monotonic(),
        {"splitserve.computed_tokens": prompt_len - cached, "splitserve.cached_tokens": cached},
    )


def _trace_transfer(response: nodes_pb2.PrefillResponse, began: float) -> None:
    """The KV transfer into the decode node, from ``began`` until now."""
    tracing.record(
        "kv_transfer",
        began,
        time.monotonic(),
        {
            "splitserve.transfer_path": response.transfer_path,
            "splitserve.blocks_shipped": response.blocks_shipped,
            "splitserve.blocks_skipped": response.blocks_reused,
            "splitserve.bytes": response.bytes_shipped,
        },
    )


def _all_counters(counters: Counter[str], figures: EngineFigures) -> dict[str, float]:
    """A prefill node's counters: its own, and the engine's (its steps and their time, the prefix
    cache's look-ups) but preemptions, a decode node's figure (not exported by a prefill node)."""
    engine = {name: value for name, value in figures.counters.items() if name != names.PREEMPTIONS}
    return {**counters, **engine}
