"""Layer-wise KV streaming: a prefill node ships each layer of a prompt's blocks as soon as the
forward has written it, so the transfer of a long prompt runs under its own prefill instead of
after it.

A stream is one request's reservation on a decode node (its ticket) and, per reserved position,
the index of the request's block that fills it. It is opened on the engine thread, between steps
(``LLMEngine.open_stream``), best before the request is added (a prompt that fits one step would
otherwise be computed before its stream is there): it is attached when the request joins the
engine; the blocks already complete then (a cached prefix, chunks computed before) are queued
whole at once. Each later step that completes some of its blocks
(the chunk's full blocks; the tail with the prompt's last chunk) has the model call back after
every layer (``StepHook.layer_done``): the step's pieces of that layer are queued behind a CUDA
event recorded there (on a CPU the layer is written when the callback runs). One sender thread per
engine takes the queue in order, merges the layers of a piece that are already done, and hands
them to the path's ``send_part`` (only paths that write a layer range: ``KVSender.layered``),
``SENDS_IN_FLIGHT`` sends at a time: one piece's round trip overlaps the next ones'.
After the request's last prefill step the stream's end is queued: its future then holds the
bytes sent, once the receiver acknowledged every piece.

The blocks stay the request's while the stream runs (a prefill-only request holds them until the
node releases it, after the stream ended). A request that is aborted, does not fit or is
preempted (its blocks freed) fails its stream; pieces queued before still go out (into a
reservation the caller cancels next), none after.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from splitserve.transfer.errors import StreamFailed, TransferError

logger = logging.getLogger(__name__)

SENDS_IN_FLIGHT = 2  # a stream's pieces sent at once (each over the path's own connections)


@dataclass(eq=False)
class _Stream:
    request_id: str
    ticket: bytes
    index: list[int]  # per reserved position: the request's block index that fills it
    deadline: float
    epoch: int  # the request's epoch when opened (a preemption changes it)
    future: Future = field(default_factory=Future)
    todo: set[int] = field(default_factory=set)  # positions not queued yet
    nbytes: int = 0
    failed: bool = False
    in_flight: int = 0  # its sends not acknowledged yet
    end: _End | None = None  # its end, once queued: resolved when nothing is in flight


@dataclass(eq=False)
class _Piece:
    stream: _Stream
    runs: list[tuple[int, list[int]]]  # (first position, source block ids) runs
    lo: int
    hi: int
    event: Any = None  # CUDA event the layers are written at (None: now, or the engine stream)


@dataclass(eq=False)
class _End:
    stream: _Stream
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class StepRow:
    """One scheduled request's share of a step, as the streams see it."""

    request_id: str
    epoch: int
    start: int  # tokens computed before the step
    num_tokens: int  # tokens the step computes
    prompt_len: int
    block_ids: Sequence[int]


class LayerStreams:
    """The streams of one engine and the thread that sends their pieces (``sender``: the
    node's transfer sender, a ``KVSender`` whose ``send_part`` moves a layer range)."""

    def __init__(self, sender: Any, num_layers: int, block_size: int, cuda: bool) -> None:
        self.sender = sender
        self.num_layers = num_layers
        self.block_size = block_size
        self.cuda = cuda
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._pending: dict[str, _Stream] = {}  # opened before their request was added
        self._queue: queue.SimpleQueue[_Piece | _End | None] = queue.SimpleQueue()
        # Sends run SENDS_IN_FLIGHT at a time, so that one piece's round trip (gather, wire,
        # the receiver's write, its acknowledgement) overlaps the next ones: waiting for each
        # piece in turn left the wire idle between layers.
        self._sends = ThreadPoolExecutor(SENDS_IN_FLIGHT, thread_name_prefix="kv-layer-send")
        self._slots = threading.Semaphore(SENDS_IN_FLIGHT)
        self._mu = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-layer-stream", daemon=True)
        self._thread.start()

    def __bool__(self) -> bool:
        return bool(self._streams or self._pending)

    # ------------------------------------------------------------------ engine thread

    def open(self, request_id: str, ticket: bytes, index: Sequence[int], timeout: float) -> Future:
        """Register a stream for the request (engine thread), before it is added (the engine
        then ``attach``es it in ``add_request``, before any step can compute it) or after
        (``attach`` at once). ``ValueError``: the request has a stream already."""
        if request_id in self._streams or request_id in self._pending:
            raise ValueError(f"request {request_id} already has a stream")
        index = list(index)
        if len(set(index)) != len(index) or any(b < 0 for b in index):
            raise ValueError("the block indices are repeated or negative")
        stream = _Stream(request_id, ticket, index, time.monotonic() + timeout, 0)
        self._pending[request_id] = stream
        return stream.future

    def attach(
        self,
        request_id: str,
        epoch: int,
        block_ids: Sequence[int],
        complete_tokens: int,
        prompt_len: int,
        prefill_done: bool,
    ) -> None:
        """The request of a registered stream is in the engine (engine thread; nothing if it
        has no stream waiting): ``block_ids`` its blocks now, ``complete_tokens`` its prompt
        tokens whose KV is written or queued on the device, ``prefill_done``: no step of its
        prefill is left. The blocks complete now are queued whole."""
        stream = self._pending.pop(request_id, None)
        if stream is None:
            return
        num_blocks = -(-prompt_len // self.block_size)
        bad = [b for b in stream.index if b >= num_blocks]
        if bad:
            why = f"block indices {bad[:8]} are not the prompt's ({num_blocks} blocks)"
            stream.future.set_exception(StreamFailed(f"request {request_id}: {why}"))
            return
        stream.epoch = epoch
        stream.todo = set(range(len(stream.index)))
        self._streams[request_id] = stream
        ready = self._completed(stream, complete_tokens, prompt_len)
        if ready:
            self._queue.put(
                _Piece(stream, self._runs(stream, ready, block_ids), 0, self.num_layers)
            )
        if prefill_done:
            self._end(stream)

    def before_step(self, rows: Sequence[StepRow]) -> StepHook | None:
        """A step is about to be launched (engine thread): its hook (None: no stream has a piece
        in it). Call the hook's ``layer_done`` after each layer, then ``finish`` once the
        forward is launched (or failed)."""
        pieces: list[tuple[_Stream, list[tuple[int, list[int]]]]] = []
        ending: list[_Stream] = []
        for row in rows:
            stream = self._streams.get(row.request_id)
            if stream is None:
                continue
            if row.epoch != stream.epoch:  # preempted since it opened: its blocks were freed
                self.drop(row.request_id, "the request was preempted on the prefill node")
                continue
            end = row.start + row.num_tokens
            done = self._completed(stream, end, row.prompt_len)
            if done:
                pieces.append((stream, self._runs(stream, done, row.block_ids)))
            if end >= row.prompt_len:
                ending.append(stream)
        for stream in ending:
            self._streams.pop(stream.request_id, None)
        if not pieces and not ending:
            return None
        return StepHook(self._queue.put, pieces, ending, self.num_layers, self.cuda)

    def drop(self, request_id: str, why: str) -> None:
        """The request ended without its prefill (engine thread): its stream fails."""
        stream = self._streams.pop(request_id, None) or self._pending.pop(request_id, None)
        if stream is not None:
            self._queue.put(_End(stream, StreamFailed(f"request {request_id}: {why}")))

    def close(self) -> None:
        for request_id in [*self._streams, *self._pending]:
            self.drop(request_id, "the engine stopped")
        self._queue.put(None)

    def _end(self, stream: _Stream) -> None:
        self._streams.pop(stream.request_id, None)
        self._queue.put(_End(stream))

    def _completed(self, stream: _Stream, tokens: int, prompt_len: int) -> list[int]:
        """Positions not queued yet whose block is complete once ``tokens`` prompt tokens are
        (taken off ``todo``)."""
        size = self.block_size
        done = sorted(
            p for p in stream.todo if min((stream.index[p] + 1) * size, prompt_len) <= tokens
        )
        stream.todo.difference_update(done)
        return done

    @staticmethod
    def _runs(
        stream: _Stream, positions: list[int], block_ids: Sequence[int]
    ) -> list[tuple[int, list[int]]]:
        """Consecutive positions as (first, source block ids) runs."""
        runs: list[tuple[int, list[int]]] = []
        for p in positions:
            src = block_ids[stream.index[p]]
            if runs and runs[-1][0] + len(runs[-1][1]) == p:
                runs[-1][1].append(src)
            else:
                runs.append((p, [src]))
        return runs

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        try:
            self._take_queue()
        finally:
            self._sends.shutdown(wait=False)

    def _take_queue(self) -> None:
        while (item := self._queue.get()) is not None:
            batch = [item]
            while True:  # what else is queued: layers already done merge into one send
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                batch.append(more)
            for work in _merged(batch):
                self._do(work)

    def _do(self, work: _Piece | _End) -> None:
        stream = work.stream
        if isinstance(work, _End):
            with self._mu:
                stream.end = work
                self._resolve(stream)
            return
        for first, src in work.runs:
            if stream.failed:
                return
            left = stream.deadline - time.monotonic()
            if left <= 0:
                self._fail(stream, StreamFailed("the stream's deadline passed"))
                return
            self._slots.acquire()  # at most SENDS_IN_FLIGHT, over all streams
            with self._mu:
                stream.in_flight += 1
            try:
                sent = self._sends.submit(
                    self.sender.send_part,
                    stream.ticket, first, src, (work.lo, work.hi), timeout=left, after=work.event,
                )  # fmt: skip
            except RuntimeError as exc:  # shut down: the engine stopped
                self._slots.release()
                with self._mu:
                    stream.in_flight -= 1
                self._fail(stream, StreamFailed(str(exc)))
                return
            sent.add_done_callback(lambda done, stream=stream: self._sent(stream, done))

    def _sent(self, stream: _Stream, done: Future) -> None:
        """A send ended (a worker thread): count it, fail the stream on its error."""
        self._slots.release()
        exc = done.exception()
        with self._mu:
            stream.in_flight -= 1
            if exc is None:
                stream.nbytes += done.result()
            else:
                self._fail_locked(stream, exc)
            self._resolve(stream)

    def _fail(self, stream: _Stream, exc: BaseException) -> None:
        with self._mu:
            self._fail_locked(stream, exc)
            self._resolve(stream)

    @staticmethod
    def _fail_locked(stream: _Stream, exc: BaseException) -> None:
        if not stream.failed:
            logger.info("layer stream of %s failed: %s", stream.request_id, exc)
        stream.failed = True
        if not stream.future.done():
            stream.future.set_exception(
                exc if isinstance(exc, TransferError) else StreamFailed(str(exc))
            )

    @staticmethod
    def _resolve(stream: _Stream) -> None:
        """The stream's future, once its end is queued and none of its sends is in flight."""
        end = stream.end
        if end is None or stream.in_flight or stream.future.done():
            return
        if end.error is not None or stream.failed:
            stream.future.set_exception(end.error or StreamFailed("a piece failed"))
        else:
            stream.future.set_result(stream.nbytes)


class StepHook:
    """One step's pieces of the streams: queued layer by layer as the forward writes them."""

    def __init__(
        self,
        put: Callable[[Any], None],
        pieces: list[tuple[_Stream, list[tuple[int, list[int]]]]],
        ending: list[_Stream],
        num_layers: int,
        cuda: bool,
    ) -> None:
        self._put, self._pieces, self._ending = put, pieces, ending
        self._layers, self._cuda = num_layers, cuda
        self._next = 0  # the first layer not queued yet

    def layer_done(self, layer: int) -> None:
        """The forward wrote ``layer``'s KV (queued on the device's current stream)."""
        if layer != self._next:
            return  # (a forward of another model's layers: not ours)
        event = None
        if self._cuda:
            import torch

            event = torch.cuda.Event()
            event.record()
        for stream, runs in self._pieces:
            self._put(_Piece(stream, runs, layer, layer + 1, event))
        self._next = layer + 1

    def finish(self, error: BaseException | None = None) -> None:
        """The forward is launched (``error``: it failed). Layers no callback announced (a
        forward without them) are queued behind everything on the engine's stream; the streams
        whose prompt this step ended are ended."""
        if error is None and self._next < self._layers:
            for stream, runs in self._pieces:
                self._put(_Piece(stream, runs, self._next, self._layers))
            self._next = self._layers
        for stream in self._ending:
            why = None if error is None else StreamFailed(f"the prefill step failed: {error}")
            self._put(_End(stream, why))
        self._ending = []


def _merged(batch: list[_Piece | _End]) -> list[_Piece | _End]:
    """Consecutive pieces of one stream step with adjacent layers, the later ones already
    written on the device, as one piece (fewer, larger sends while the forward runs ahead)."""
    out: list[_Piece | _End] = []
    for work in batch:
        last = out[-1] if out else None
        if (
            isinstance(work, _Piece)
            and isinstance(last, _Piece)
            and last.stream is work.stream
            and last.runs is work.runs
            and last.hi == work.lo
            and (work.event is None or work.event.query())
        ):
            out[-1] = _Piece(last.stream, last.runs, last.lo, work.hi, work.event)
            continue
        out.append(work)
    return out
