"""The public ``Router.Generate`` servicer: validate, prefill on P shipping to D, relay D's stream.

Failure handling, per stage:

- ``RESOURCE_EXHAUSTED`` from Prefill (P or D full): try another pair, up to ``max_attempts``,
  with a short back-off when a node that refused must be asked again.
- ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` (before the request's own deadline): P is probed with
  grpc.health.v1; a healthy P means D was unreachable. The failed node is marked down and the
  stage retried elsewhere. No node left → ``UNAVAILABLE`` naming every node's state.
- The Decode stream failing mid-request cannot be retried (tokens were already sent): the
  client gets ``UNAVAILABLE`` and D is marked down.
- Client cancel/disconnect cancels the in-flight node call; the nodes free the request's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from splitserve.kvstore import hash_request_tokens
from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.router.output import Delta, OutputAssembler
from splitserve.router.registry import Node, NodePool, NodeRegistry, prompt_tokens_to_compute
from splitserve.router.request import (
    GenerateParams,
    InvalidRequest,
    ModelInfo,
    parse_request,
)
from splitserve.runtime.metrics import RouterMetrics
from splitserve.runtime.protocol import sampling_to_proto
from splitserve.v1 import common_pb2, nodes_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0  # how long an abandoned Decode call waits for the node's first answer
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class GenerateError(Exception):
    """Ends a request with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class _Prefilled:
    response: nodes_pb2.PrefillResponse
    decode_node: Node  # still counted as in flight: the caller releases it
    node_request_id: str


class _LookupBatcher:
    """Coalesces the prefix-index lookups of concurrent requests: the first lookup goes out at
    once; those arriving while it is in flight go together in the next pipeline. A burst of
    requests then costs a few Redis round trips on one connection instead of one each (and a
    connection each: the pool would grow to the burst)."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._queue: list[tuple[list[str], list[bytes], asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def lookup(self, node_ids: list[str], hashes: list[bytes]) -> dict[str, int]:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((node_ids, hashes, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                results = await self._index.longest_prefixes_many([(n, h) for n, h, _ in batch])
            except Exception as exc:  # every caller hears of it (and routes by load)
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            except BaseException:  # cancelled (the router is stopping): nobody waits forever
                for *_, future in batch:
                    future.cancel()
                raise
            for (*_, future), result in zip(batch, results, strict=True):
                if not future.done():  # the caller may have timed out
                    future.set_result(result)


class RouterService(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self,
        model: ModelInfo,
        registry: NodeRegistry,
        max_attempts: int = 3,
        request_timeout_s: float = 600.0,
        index: PrefixIndex | None = None,
        block_size: int = 16,
        metrics: RouterMetrics | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._model = model
        self._registry = registry
        self._max_attempts = max_attempts
        self._request_timeout_s = request_timeout_s
        self._background: set[asyncio.Task] = set()
        self._index = index
        self._lookups = _LookupBatcher(index) if index is not None else None
        self._block_size = block_size
        self._index_ok = True
        self._metrics = metrics or RouterMetrics()

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        start = time.monotonic()
        try:
            params = parse_request(request, self._model)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()
        budget = self._request_timeout_s if remaining is None else remaining
        deadline = start + min(budget, self._request_timeout_s)
        m = self._metrics
        code = "CANCELLED"  # unless the stream ends otherwise: the client went away
        last = None
        try:
            async for msg in self._generate(params, start, deadline):
                if msg.token_ids:
                    now = time.monotonic()
                    if last is None:
                        m.ttft.observe(now - start)
                    else:
                        for _ in msg.token_ids:
                            m.itl.observe((now - last) / len(msg.token_ids))
                    last = now
                if msg.finish_reason:
                    code = "OK"
                    m.prompt_tokens.inc(msg.usage.prompt_tokens)
                    m.cached_tokens.inc(msg.usage.cached_tokens)
                    m.generation_tokens.inc(msg.usage.completion_tokens)
                yield msg
        except GenerateError as exc:
            code = exc.code.name
            logger.info("request %s failed: %s %s", params.request_id, exc.code.name, exc)
            await context.abort(exc.code, exc.message)
        finally:
            m.requests.labels(code).inc()
            m.latency.observe(time.monotonic() - start)

    async def _generate(
        self, params: GenerateParams, start: float, deadline: float
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        prefilled = await self._prefill(params, deadline)
        decode_pool = self._registry.decode
        node = prefilled.decode_node
        try:
            first = prefilled.response
            ttft = time.monotonic() - start
            usage = common_pb2.Usage(
                prompt_tokens=len(params.prompt_token_ids),
                cached_tokens=first.cached_tokens,
                time_to_first_token_s=ttft,
            )
            output = OutputAssembler(self._model.tokenizer, params.stop)

            def message(delta: Delta) -> router_pb2.GenerateResponse:
                msg = router_pb2.GenerateResponse(
                    text=delta.text,
                    token_ids=delta.token_ids,
                    logprobs=delta.logprobs if params.sampling.logprobs else (),
                    finish_reason=delta.finish_reason,
                    request_id=params.request_id,
                )
                if delta.finish_reason:
                    usage.completion_tokens = output.num_tokens
                    msg.usage.CopyFrom(usage)
                return msg

            delta = output.add([first.first_token_id], [first.first_logprob], first.finish_reason)
            if output.finished:
                decode_pool.release(node)
                node = None
                # NOTE: a stop string on the first token: D holds the shipped blocks until
                # its transfer deadline unless told; a Decode call cancelled at once frees them.
                if not first.finish_reason:
                    self._discard(prefilled)
                yield message(delta)
                return
            stub = self._registry.decode_stub(node)
            # NOTE: started before the first token is yielded, to overlap with the yield.
            call = stub.Decode(
                nodes_pb2.DecodeRequest(request_id=prefilled.node_request_id),
                timeout=max(deadline - time.monotonic(), 0.001),
            )
            # NOTE: a cancel that reaches D before its Decode handler has started is dropped
            # by gRPC, and D would hold the blocks until its transfer deadline. Until D has
            # answered once, the read is shielded from our own cancellation, and an abandoned
            # call is cancelled only once D has answered (see _cancel_once_started).
            first_read: asyncio.Future | None = asyncio.ensure_future(call.read())
            try:
                yield message(delta)
                while True:
                    if first_read is not None:
                        reply = await asyncio.shield(first_read)
                        first_read = None
                    else:
                        reply = await call.read()
                    if reply is grpc.aio.EOF:
                        raise GenerateError(
                            grpc.StatusCode.INTERNAL,
                            f"decode node {node.address} ended the stream without finishing",
                        )
                    delta = output.add(reply.token_ids, reply.logprobs, reply.finish_reason)
                    yield message(delta)
                    if output.finished:
                        return
            except grpc.aio.AioRpcError as exc:
                raise self._decode_error(node, exc, deadline) from None
            finally:
                if first_read is None:
                    call.cancel()  # no-op when the call has finished
                else:
                    self._cancel_once_started(call, first_read)
        finally:
            if node is not None:
                decode_pool.release(node)

    def _decode_error(self, node: Node, exc: grpc.aio.AioRpcError, deadline: float):
        code, details = exc.code(), exc.details()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline:
            return GenerateError(code, "the request's deadline passed while decoding")
        if code in _UNREACHABLE:
            self._registry.decode.mark_down(node, f"{code.name}: {details}")
            return GenerateError(
                grpc.StatusCode.UNAVAILABLE,
                f"decode node {node.address} failed mid-request ({details}); retry the request",
            )
        if code == grpc.StatusCode.NOT_FOUND:
            return GenerateError(
                grpc.StatusCode.INTERNAL,
                f"decode node {node.address} no longer holds the request's KV ({details})",
            )
        return GenerateError(code, f"decode node {node.address}: {details}")

    def _discard(self, prefilled: _Prefilled) -> None:
        """Free a transferred request on its decode node without waiting for its deadline:
        start its Decode and cancel it (in the background; the client has its answer)."""
        stub = self._registry.decode_stub(prefilled.decode_node)
        call = stub.Decode(nodes_pb2.DecodeRequest(request_id=prefilled.node_request_id))
        self._cancel_once_started(call, asyncio.ensure_future(call.read()))

    def _cancel_once_started(self, call: grpc.aio.UnaryStreamCall, first_read: asyncio.Future):
        """Cancel ``call`` in the background once the node has answered (so its handler runs
        and sees the cancel), or after CANCEL_WAIT_S at the latest."""

        async def cancel() -> None:
            try:
                await asyncio.wait_for(first_read, CANCEL_WAIT_S)
            except (Exception, asyncio.CancelledError):
                pass  # timed out, failed or ended: cancel in any case
            finally:
                call.cancel()

        task = asyncio.create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cached_blocks(self, params: GenerateParams) -> dict[str, int]:
        """Leading blocks of the prompt each node holds, per the prefix index (one round trip);
        empty without an index or while Redis is unreachable: routing by load alone."""
        if self._index is None:
            return {}
        hashes = hash_request_tokens(
            params.prompt_token_ids,
            self._block_size,
            self._index.root_hash,
            params.cache_salt or None,
        )
        if not hashes:
            return {}
        reg = self._registry
        addresses = [n.address for pool in (reg.prefill, reg.decode) for n in pool.nodes]
        try:
            cached = await asyncio.wait_for(self._lookups.lookup(addresses, hashes), 0.5)
        except Exception as exc:  # Redis down or slow, or anything else: route by load
            if self._index_ok:
                logger.warning("prefix index unreachable (%s): routing by load only", exc)
            self._index_ok = False
            return {}
        if not self._index_ok:
            logger.info("prefix index reachable again")
        self._index_ok = True
        return cached

    async def _prefill(self, params: GenerateParams, deadline: float) -> _Prefilled:
        """Run Prefill on some P shipping to some D, retrying elsewhere on refusals/failures."""
        reg = self._registry
        unreachable: set[Node] = set()
        busy: set[Node] = set()
        error = GenerateError(grpc.StatusCode.UNAVAILABLE, "no attempt made")
        cached = await self._cached_blocks(params)
        for attempt in range(self._max_attempts):
            if attempt:
                self._metrics.retries.inc()
            n_prompt = len(params.prompt_token_ids)
            p = _choose(reg.prefill, unreachable, busy, cached, n_prompt, self._block_size)
            d = _choose(reg.decode, unreachable, busy, cached)
            if p is None or d is None:
                pool = reg.prefill if p is None else reg.decode
                raise GenerateError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no {pool.role} node is reachable ({pool.describe()}); "
                    "start one or check the router's --prefill/--decode addresses",
                )
            if attempt and (p in busy or d in busy):
                await asyncio.sleep(min(0.05 * 2**attempt, max(deadline - time.monotonic(), 0)))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GenerateError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed in prefill"
                )
            node_request_id = f"{params.request_id}-{secrets.token_hex(4)}"
            request = nodes_pb2.PrefillRequest(
                request_id=node_request_id,
                prompt_token_ids=params.prompt_token_ids,
                sampling=sampling_to_proto(params.sampling),
                cache_salt=params.cache_salt,
                decode_address=d.address,
                **_peer_hint(reg.prefill, p, cached, unreachable),
            )
            work = prompt_tokens_to_compute(n_prompt, cached.get(p.address, 0), self._block_size)
            reg.prefill.acquire(p, work)
            reg.decode.acquire(d)
            ok = False
            try:
                call = reg.prefill_stub(p).Prefill(request, timeout=remaining)
                try:
                    response = await call
                finally:
                    call.cancel()
                ok = True
                return _Prefilled(response, d, node_request_id)
            except grpc.aio.AioRpcError as exc:
                error = await self._prefill_error(p, d, exc, deadline, unreachable, busy)
                logger.info(
                    "request %s: prefill attempt %d/%d failed: %s",
                    params.request_id,
                    attempt + 1,
                    self._max_attempts,
                    error.message,
                )
            finally:
                reg.prefill.release(p, work)
                if not ok:
                    reg.decode.release(d)
        raise error

    async def _prefill_error(
        self,
        p: Node,
        d: Node,
        exc: grpc.aio.AioRpcError,
        deadline: float,
        unreachable: set[Node],
        busy: set[Node],
    ) -> GenerateError:
        """Classify a failed Prefill; raise when retrying cannot help, else return the error."""
        code, details = exc.code(), exc.details()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            busy.update((p, d))
            return GenerateError(
                code, f"every node tried is full (last: {details}); retry later or add nodes"
            )
        if code not in _UNREACHABLE:
            raise GenerateError(code, details or f"prefill node {p.address} failed: {code.name}")
        if time.monotonic() >= deadline:
            raise GenerateError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed in prefill"
            )
        reason = f"{code.name}: {details}"
        probe_timeout = min(1.0, max(deadline - time.monotonic(), 0.01))
        if await self._registry.probe(p, timeout=probe_timeout):
            culprit, pool = d, self._registry.decode  # P answers: its target D was the problem
        else:
            culprit, pool = p, self._registry.prefill
        pool.mark_down(culprit, reason)
        unreachable.add(culprit)
        return GenerateError(
            grpc.StatusCode.UNAVAILABLE,
            f"no {pool.role} node reachable: {culprit.address} failed ({details}); "
            f"nodes: {pool.describe()}",
        )


def _peer_hint(
    pool: NodePool, chosen: Node, cached: dict[str, int], unreachable: set[Node]
) -> dict:
    """When another prefill node holds a longer prefix than the chosen one (the imbalance guard
    sent the request elsewhere), name it: the chosen node fetches those blocks from it rather
    than computing them."""
    here = cached.get(chosen.address, 0)
    peers = [n for n in pool.nodes if n is not chosen and n not in unreachable]
    best = max(peers, key=lambda n: cached.get(n.address, 0), default=None)
    if best is None or cached.get(best.address, 0) <= here:
        return {}
    return {"peer_address": best.address, "peer_blocks": cached[best.address]}


def _choose(
    pool: NodePool,
    unreachable: set[Node],
    busy: set[Node],
    cached: dict[str, int],
    prompt_tokens: int | None = None,
    block_size: int = 16,
) -> Node | None:
    """A node not yet tried by this request if any, else one that only refused (full)."""
    args = (cached, prompt_tokens, block_size)
    return pool.pick(unreachable | busy, *args) or pool.pick(unreachable, *args)
