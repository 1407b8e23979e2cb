"""The one interface a node's services have to its engine: a fixed set of commands with typed
results (``NodeEngine``), whether the engine runs in this process (``engine.local.LocalEngine``)
or in an engine process of its own (``engine.client.EngineClient``, over ``engine.protocol``).

Nothing else crosses: a service never reaches the ``LLMEngine``, its request table, its KV pool
or its transfer sides. Every command is a coroutine; the ones marked *to the end* complete
whatever cancels their caller (the cancellation is raised once they have), so a release or a
reservation is never dropped half way (``engine.loop``'s docstring says why that matters).
Blocks and transfer reservations live where the engine lives: the services hold ids.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.engine.core import StepOutput, check_prompt
from splitserve.engine.kv_port import Reserved
from splitserve.kvstore import BlockHash
from splitserve.kvstore.block_pool import BlockStored, KVCacheEvent
from splitserve.models.sampling_params import SamplingParams

__all__ = [
    "EngineFigures",
    "EngineInfo",
    "KVSides",
    "KVSpec",
    "NodeEngine",
    "OutputSink",
    "Pinned",
    "ResInfo",
    "Reserved",
    "StepOutput",
]

# The transfer sides a node's engine may hold (``KVSpec`` says which it opens):
RX = "rx"  # the receiver (decode: shipped KV; prefill: peers' prefix fetches)
TX = "tx"  # the sender shipping to decode nodes (prefill)
FETCH_TX = "fetch_tx"  # the sender serving peers' prefix fetches (prefill)
SIDES = (RX, TX, FETCH_TX)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What does not change while the engine lives: sent once, at start."""

    root_hash: bytes  # the model identity's (ModelIdentity.root_hash)
    identity: str  # str(ModelIdentity)
    device: str  # "cpu", "cuda:0", ...
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab_size: int
    block_size: int
    block_nbytes: int
    num_usable_blocks: int
    num_params: int  # the model's parameter count (priors of the prefill rate)
    pid: int  # the process the engine runs in
    tensor_parallel_size: int = 1  # ranks the model is split over (engine.ranks)
    host_tier: bool = False  # a host KV tier sits behind the pool (``read_tier`` reads it)

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as a list, or ``ValueError`` saying what is wrong with it (the engine's
        own check, made from these figures)."""
        return check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Which transfer sides to open where the engine lives, and how (a node's config, after
    ``runtime.node`` resolved it): ``paths`` as ``transfer.parse_paths`` gives them."""

    role: str  # "prefill" | "decode"
    address: str  # the node's advertised host:port (its transfer ids start with it)
    paths: tuple[str, ...]
    host: str  # where receivers listen
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    trust_network: bool = False
    rendezvous_key: bytes | None = None
    stream_layers: bool = True  # a prefill node ships KV layer by layer where its path can


@dataclass(frozen=True, slots=True)
class KVSides:
    """The transfer sides an engine opened: their ids, paths and endpoints (what a service puts
    in headers and in ``GetStats.transfer_endpoint``). Empty strings/tuples: not opened."""

    rx_id: str = ""
    rx_paths: tuple[str, ...] = ()
    rx_endpoint: bytes = b""
    tx_id: str = ""
    tx_paths: tuple[str, ...] = ()
    tx_layered: tuple[str, ...] = ()  # the tx paths that stream layer by layer (tx_stream)
    fetch_paths: tuple[str, ...] = ()
    fetch_endpoint: bytes = b""  # the fetch sender's: askers choose a fetch path from it

    def opened(self, side: str) -> bool:
        return bool({RX: self.rx_id, TX: self.tx_id, FETCH_TX: self.fetch_paths}[side])


@dataclass(frozen=True, slots=True)
class ResInfo:
    """A transfer reservation made where the engine lives (``transfer.Reservation``), as the
    services see it: its id for the later commands and what it says of itself."""

    res_id: int
    path: str  # "": the byte path (the blocks come in the caller's stream)
    caller_writes: bool
    receive_first: bool
    ticket: bytes  # for the sender (empty on the byte path)
    nbytes: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Pinned:
    """Cached blocks pinned for reading (``KVPort.pin``): the id to unpin them with and their
    block ids, the longest leading run of the hashes asked for."""

    pin_id: int
    block_ids: list[int]


class OutputSink(Protocol):
    """Where a request's outputs go (``NodeEngine.subscribe``): an ``asyncio.Queue`` per request,
    or one object many requests share (``decode_node.relay_stream``: every request of one
    router's stream, sent once per step)."""

    def put_nowait(self, item: StepOutput | BaseException, /) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """The engine's figures, read without waiting for a step: load, pool and counters."""

    running: int = 0
    waiting: int = 0  # queued (ready requests included)
    num_blocks: int = 0  # usable blocks
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    prefill_tokens_waiting: int = 0
    kv_tokens_held: int = 0
    kv_token_slots: int = 0
    num_requests: int = 0  # in the engine's request table (decoding, prefilling, queued)
    counters: dict[str, float] = field(default_factory=dict)  # steps, preemptions, prefix...
    # seconds per block a load takes from each KV tier ("host", "disk", "store"), as measured
    tier_block_load_s: dict[str, float] = field(default_factory=dict)


class NodeEngine(ABC):
    """A node's engine, as its services use it. ``info`` is set once started; ``kv`` once
    ``open_kv`` has run."""

    info: EngineInfo
    kv: KVSides = KVSides()

    def __init__(self) -> None:
        self._queues: dict[str, OutputSink] = {}

    # ------------------------------------------------------------------ life

    @abstractmethod
    async def stop(self) -> None:
        """Stop the engine (steps, transfer sides, the engine process); idempotent."""

    # ------------------------------------------------------------------ requests

    def subscribe(self, request_id: str) -> asyncio.Queue[StepOutput | BaseException]:
        """The queue a request's outputs (or the exception that failed it) arrive on; call
        before adding the request."""
        queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.subscribe_sink(request_id, queue)
        return queue

    def subscribe_sink(self, request_id: str, sink: OutputSink) -> None:
        """Like ``subscribe``, the outputs put into ``sink`` (called on the event loop, in step
        order; one step's outputs one after another, with no await between them)."""
        self._queues[request_id] = sink

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _deliver(self, outputs: Sequence[StepOutput]) -> None:
        """One step's outputs (event loop): each to its request's queue."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail(self, request_ids: Sequence[str], exc: BaseException) -> None:
        for rid in request_ids:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(exc)

    @abstractmethod
    async def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, salt: str | None
    ) -> None:
        """Queue a prompt (prefill-only on a prefill node: it ends after its first token and
        keeps its blocks until ``abort``). Its first output carries ``facts``. ``ValueError``:
        the id is taken or the prompt cannot run."""

    @abstractmethod
    async def add_transferred(
        self,
        request_id: str,
        prompt: list[int],
        first_token: int,
        params: SamplingParams,
        salt: str | None,
    ) -> None:
        """Join a request whose prompt KV was adopted under its id; it decodes from the next
        step on. ``ValueError``: the id is taken."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Drop the request and free its blocks (prefill: they stay cached); idempotent, to the
        end. Only the step already running when it is called still computes it."""

    @abstractmethod
    async def end_request(self, request_id: str) -> bool:
        """``abort``, and free blocks adopted under the id that never joined the engine; True
        if it was in the engine. Idempotent, to the end."""

    # ------------------------------------------------------------------ KV blocks

    @abstractmethod
    async def reserve(
        self, request_id: str, block_hashes: list[BlockHash], prompt_len: int
    ) -> Reserved | None:
        """Reserve blocks for KV shipped from elsewhere (``KVPort.reserve``; None: the pool is
        short). To the end: a cancelled caller still frees with ``free``."""

    @abstractmethod
    async def register(self, request_id: str, block_hashes: list[BlockHash]) -> None:
        """The reserved blocks' data is in: make their hashes findable. To the end."""

    @abstractmethod
    async def free(self, request_id: str) -> None:
        """Free every block held under the id; idempotent, to the end."""

    @abstractmethod
    async def holds(self, request_id: str) -> bool: ...

    @abstractmethod
    async def count_cached(self, block_hashes: list[BlockHash]) -> int: ...

    @abstractmethod
    async def adopt(self, block_hashes: list[BlockHash], blocks_data: list[bytes]) -> int:
        """Write fetched blocks' bytes into the prefix cache (reserve, write, register and
        release in one command); how many were adopted."""

    @abstractmethod
    async def pin(self, block_hashes: list[BlockHash]) -> Pinned:
        """Pin the leading cached run of the hashes; a caller cancelled before it hears the
        answer has them unpinned for it."""

    @abstractmethod
    async def unpin(self, pin_id: int) -> None:
        """Idempotent, to the end."""

    @abstractmethod
    async def read(self, block_ids: list[int]) -> bytes: ...

    @abstractmethod
    async def read_tier(self, block_hashes: list[BlockHash]) -> list[bytes]:
        """The bytes of the leading run of the hashes held in the host tier's memory."""

    @abstractmethod
    async def block_ids(self, request_id: str) -> list[int]: ...

    @abstractmethod
    async def take_events(self) -> list[KVCacheEvent]: ...

    @abstractmethod
    async def cache_snapshot(self) -> list[BlockStored]: ...

    # ------------------------------------------------------------------ figures

    @abstractmethod
    async def figures(self) -> EngineFigures:
        """Fresh figures (without waiting for a step)."""

    @abstractmethod
    def last_figures(self) -> EngineFigures:
        """The latest figures known, without waiting (a metrics thread's read)."""

    # ------------------------------------------------------------------ transfer sides

    @abstractmethod
    async def open_kv(self, spec: KVSpec) -> KVSides:
        """Open the node's transfer sides where the engine lives (once); sets ``kv``."""

    @abstractmethod
    async def rx_reserve(self, side: str, peer_id: str, block_ids: list[int], path: str) -> ResInfo:
        """``KVReceiver.reserve`` on ``side`` (``RX``): ``ValueError``/``TransferError``."""

    @abstractmethod
    async def rx_write(self, side: str, res_id: int, block_ids: list[int], data: bytes) -> None:
        """Blocks that came in the caller's stream into its reservation (byte path)."""

    @abstractmethod
    async def rx_receive(self, side: str, res_id: int, timeout: float) -> None:
        """Where the path takes the data in itself: until it is in (``TransferError``)."""

    @abstractmethod
    async def rx_finish(self, side: str, res_id: int, count: int | None = None) -> None:
        """The sender finished: the reservation ends done, or this raises."""

    @abstractmethod
    async def rx_cancel(self, side: str, res_id: int) -> float:
        """Abandon the reservation (idempotent, to the end); the seconds to wait before
        freeing its blocks (the ipc grace)."""

    @abstractmethod
    async def tx_connect(self, side: str, endpoint: bytes) -> str:
        """Set up the path to a receiver (``KVSender.connect``); its name."""

    @abstractmethod
    async def tx_close(self, side: str, peer_id: str) -> None:
        """The receiver ``peer_id`` left (or is dropped): the sender forgets its path."""

    @abstractmethod
    async def tx_send(
        self, side: str, ticket: bytes, src_block_ids: list[int], timeout: float
    ) -> int:
        """Fill a receiver's reservation from our blocks; bytes moved. To the end: a copy into
        another node's blocks is never left running behind a cancelled caller."""

    @abstractmethod
    async def tx_stream_open(
        self, side: str, ticket: bytes, request_id: str, block_index: list[int], timeout: float
    ) -> None:
        """Have the engine fill a receiver's reservation (on a ``tx_layered`` path) with the
        request's blocks ``block_index`` (indices into its blocks, one per reserved position),
        layer by layer as its prefill writes them (``engine.layer_stream``). Call it before
        ``add_request`` (after, blocks already complete go at once, but a prompt of one step may
        be computed before the stream is there); ``abort`` ends a stream whose request never
        came. ``ValueError``: no stream on this side, or the request has one."""

    @abstractmethod
    async def tx_stream_wait(self, side: str, request_id: str) -> int:
        """The end of the request's stream: bytes moved, once all are in. To the end, like
        ``tx_send``; ``StreamFailed`` when the request ended without its prefill."""
