"""Layer-wise KV streams (engine.layer_stream) on a real CPU engine: a prefill-only request's
blocks leave layer by layer as its chunked prefill writes them, each (block, layer) exactly once
and with the bytes the pool ends with; a stream opened late sends what is complete at once; a
request that ends without its prefill, or a piece that fails, fails the stream; pieces go two
at a time (one's round trip does not hold up the next).

The sender here is an in-process recorder (the tcp path's ``send_part`` over real sockets is in
tests/cluster/test_transfer_tcp.py and end to end in tests/cluster/test_layer_streaming.py): it
copies what it is asked to send at the moment it is asked, so bytes sent before the forward
wrote them would differ from the pool's final ones."""

import threading

import pytest
import torch

from splitserve.engine.core import LLMEngine
from splitserve.engine.layer_stream import LayerStreams, _Piece
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint
from splitserve.transfer import StreamFailed, TransferError

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [(7 * i + 3) % 300 for i in range(70)]  # 4 full blocks of 16 and a tail of 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_checkpoint(
        tmp_path_factory.mktemp("stream") / "m", seed=5, num_hidden_layers=3
    )
    return load_model(path)


class Recorder:
    """A sender that copies each piece when asked (``fail``: raise instead)."""

    def __init__(self, pool: torch.Tensor, positions: int) -> None:
        self.pool = pool
        self.got = torch.zeros((positions, *pool.shape[1:]), dtype=pool.dtype)
        self.sent = torch.zeros((positions, pool.shape[1]), dtype=torch.int64)
        self.pieces: list[tuple[int, int, int, int]] = []
        self.fail: Exception | None = None
        self.mu = threading.Lock()

    def send_part(self, ticket, first, src, layers, *, timeout, after=None):
        assert ticket == b"ticket" and timeout > 0 and after is None  # (CPU: no events)
        if self.fail is not None:
            raise self.fail
        lo, hi = layers
        with self.mu:
            for k, block in enumerate(src):
                self.got[first + k, lo:hi] = self.pool[block, lo:hi]
                self.sent[first + k, lo:hi] += 1
            self.pieces.append((first, len(src), lo, hi))
        return len(src) * (hi - lo)


class Spy:
    """The streams' queue, with a record of what was put on it."""

    def __init__(self, queue) -> None:
        self.queue, self.items = queue, []

    def put(self, item) -> None:
        self.items.append(item)
        self.queue.put(item)

    def get(self):
        return self.queue.get()

    def get_nowait(self):
        return self.queue.get_nowait()


def u8(t: torch.Tensor) -> torch.Tensor:
    """Bytes (the tail block's slots past the prompt are uninitialised: NaN != NaN)."""
    return t.view(torch.uint8)


def _engine(model, async_scheduling=False, chunk=16):
    config, m = model
    rc = RunnerConfig(kv_cache_bytes=64 * 16 * config.kv_bytes_per_token(torch.float32))
    engine = LLMEngine(
        ModelRunner(config, m, rc),
        ModelIdentity("m"),
        prefill_only=True,
        max_num_batched_tokens=chunk,
        async_scheduling=async_scheduling,
    )
    return engine


def _attach(engine, positions):
    pool = engine.runner.kv_pool
    recorder = Recorder(pool, positions)
    engine.layer_streams = LayerStreams(recorder, pool.shape[1], engine.block_size, cuda=False)
    return recorder


def _run(engine, rid="r"):
    while rid in engine.requests or engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_chunked_prefill_streams_every_layer_of_every_block_once(model, async_scheduling):
    engine = _engine(model, async_scheduling)
    index = [0, 1, 2, 3, 4]  # every block, the tail last
    recorder = _attach(engine, len(index))
    spy = engine.layer_streams._queue = Spy(engine.layer_streams._queue)
    engine.add_request("r", PROMPT, PARAMS)
    future = engine.open_stream("r", b"ticket", index, timeout=30)
    _run(engine)
    layers = engine.runner.kv_pool.shape[1]
    assert future.result(timeout=30) == len(index) * layers
    assert bool((recorder.sent == 1).all()), recorder.sent
    ids = engine.kv.get_block_ids("r")
    final = engine.runner.kv_pool[ids]
    assert torch.equal(u8(recorder.got), u8(final))
    # Each step's pieces were queued layer by layer as its forward went on (the sender thread
    # may merge those already written by the time it takes them).
    queued = [(w.lo, w.hi) for w in spy.items if isinstance(w, _Piece)]
    assert queued.count((0, 1)) >= 4 and queued.count((layers - 1, layers)) >= 4, queued


def test_a_stream_opened_late_sends_the_complete_blocks_at_once(model):
    engine = _engine(model)
    index = [4, 1, 3]  # any order and subset: the decode node lacks these
    recorder = _attach(engine, len(index))
    engine.add_request("r", PROMPT, PARAMS)
    engine.step()
    engine.step()  # blocks 0 and 1 are complete now
    future = engine.open_stream("r", b"ticket", index, timeout=30)
    _run(engine)
    layers = engine.runner.kv_pool.shape[1]
    assert future.result(timeout=30) == len(index) * layers
    assert bool((recorder.sent == 1).all())
    ids = engine.kv.get_block_ids("r")
    assert torch.equal(u8(recorder.got), u8(engine.runner.kv_pool[[ids[i] for i in index]]))
    assert (1, 1, 0, layers) in recorder.pieces  # block 1 (position 1): whole, at once


def test_a_stream_of_a_finished_prefill_sends_everything_at_once(model):
    engine = _engine(model, chunk=128)
    engine.add_request("r", PROMPT, PARAMS)
    _run(engine)
    assert "r" in engine.held
    recorder = _attach(engine, 5)
    future = engine.open_stream("r", b"ticket", [0, 1, 2, 3, 4], timeout=30)
    layers = engine.runner.kv_pool.shape[1]
    assert future.result(timeout=30) == 5 * layers
    assert recorder.pieces == [(0, 5, 0, layers)]


def test_an_aborted_request_fails_its_stream(model):
    engine = _engine(model)
    recorder = _attach(engine, 5)
    engine.add_request("r", PROMPT, PARAMS)
    future = engine.open_stream("r", b"ticket", [0, 1, 2, 3, 4], timeout=30)
    engine.step()
    engine.abort("r")
    with pytest.raises(StreamFailed, match="aborted"):
        future.result(timeout=30)
    assert not recorder.sent[4].any()  # the tail was never computed: never sent
    assert not engine.layer_streams  # nothing left open


def test_a_failed_piece_fails_the_stream_and_nothing_more_is_sent(model):
    engine = _engine(model)
    recorder = _attach(engine, 5)
    recorder.fail = TransferError("the receiver went away")
    engine.add_request("r", PROMPT, PARAMS)
    future = engine.open_stream("r", b"ticket", [0, 1, 2, 3, 4], timeout=30)
    _run(engine)
    with pytest.raises(TransferError, match="went away"):
        future.result(timeout=30)
    assert recorder.pieces == []


def test_a_stream_opened_before_its_request_sees_a_one_step_prefill_layer_by_layer(model):
    engine = _engine(model, chunk=128)  # the whole prompt in one step
    recorder = _attach(engine, 5)
    spy = engine.layer_streams._queue = Spy(engine.layer_streams._queue)
    future = engine.open_stream("r", b"ticket", [0, 1, 2, 3, 4], timeout=30)
    engine.add_request("r", PROMPT, PARAMS)
    _run(engine)
    layers = engine.runner.kv_pool.shape[1]
    assert future.result(timeout=30) == 5 * layers
    queued = [(w.lo, w.hi) for w in spy.items if isinstance(w, _Piece)]
    assert queued == [(i, i + 1) for i in range(layers)], queued
    ids = engine.kv.get_block_ids("r")
    assert torch.equal(u8(recorder.got), u8(engine.runner.kv_pool[ids]))


def test_bad_streams_are_refused_or_fail(model):
    engine = _engine(model)
    _attach(engine, 5)
    never = engine.open_stream("nobody", b"ticket", [0], timeout=30)
    engine.abort("nobody")  # its request never came: the node aborts it
    with pytest.raises(StreamFailed, match="aborted"):
        never.result(timeout=30)
    with pytest.raises(ValueError, match="repeated"):
        engine.open_stream("r", b"ticket", [1, 1], timeout=30)
    engine.add_request("r", PROMPT, PARAMS)
    with pytest.raises(StreamFailed, match="not the prompt's"):  # 70 tokens: blocks 0..4
        engine.open_stream("r", b"ticket", [0, 5], timeout=30).result(timeout=30)
    engine.open_stream("r2", b"ticket", [0], timeout=30)
    with pytest.raises(ValueError, match="already has a stream"):
        engine.open_stream("r2", b"ticket", [1], timeout=30)
    plain = _engine(model)
    plain.add_request("r", PROMPT, PARAMS)
    with pytest.raises(ValueError, match="streams no KV"):
        plain.open_stream("r", b"ticket", [0], timeout=30)


def test_pieces_are_sent_two_at_a_time(model):
    """A piece's round trip does not hold up the next one: the first send waits for a second
    one to start (it never would if each piece waited for the one before it)."""
    engine = _engine(model)
    recorder = _attach(engine, 5)
    second_started = threading.Event()
    calls = []
    record = recorder.send_part

    def send_part(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:
            assert second_started.wait(10), "the second send never started alongside the first"
        else:
            second_started.set()
        return record(*args, **kwargs)

    recorder.send_part = send_part
    engine.add_request("r", PROMPT, PARAMS)
    future = engine.open_stream("r", b"ticket", [0, 1, 2, 3, 4], timeout=30)
    _run(engine)
    assert future.result(timeout=30) > 0
    assert (recorder.sent == 1).all()  # and still every (block, layer) exactly once
