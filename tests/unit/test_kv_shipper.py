"""KVShipper (prefill_node/shipper.py) on its own, against a fake decode node's TransferKV call:
the header names the request's full-block hashes; only the blocks the decode node says it lacks
are sent as BlockData (and the partial tail block), then TransferEnd; what was shipped and
reused is counted; a decode node that closes the stream or does not confirm is a ShipError the
router can retry elsewhere; with a real engine (``LocalEngine``), the blocks shipped are those
the prompt's first output names (``FirstFacts``). Shipping between real nodes:
tests/cluster/test_decode_transfer.py."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace

import grpc
import msgpack
import pytest
import torch

from splitserve.engine.api import TX, KVSides, KVSpec
from splitserve.engine.core import LLMEngine
from splitserve.engine.local import LocalEngine
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint
from splitserve.prefill_node import shipper as shipper_module
from splitserve.prefill_node.shipper import KVShipper, ShipError
from splitserve.runtime import counter_names as names
from splitserve.runtime.failure import Failure
from splitserve.v1 import nodes_pb2

BS, NBYTES = 16, 64
ROOT = ModelIdentity("m").root_hash


class FakeCall:
    """The decode node's side of one TransferKV call: answers the header with ``missing``, then
    confirms (``done``) once the request stream ends."""

    def __init__(self, requests, missing: list[int], confirm: bool = True, answer: bool = True):
        self.requests, self.missing, self.confirm, self.answer = requests, missing, confirm, answer
        self.received: list[nodes_pb2.TransferKVRequest] = []
        self.cancelled = False
        self._replies: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        async for msg in self.requests:
            self.received.append(msg)
            if msg.HasField("header"):
                reply = nodes_pb2.TransferKVResponse(missing=self.missing)
                self._replies.put_nowait(reply if self.answer else grpc.aio.EOF)
        self._replies.put_nowait(
            nodes_pb2.TransferKVResponse(done=True) if self.confirm else grpc.aio.EOF
        )

    async def read(self):
        return await self._replies.get()

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """What KVShipper uses of a ``NodeEngine``: its figures, no transfer sides, and ``read``
    (block ``i`` reads as NBYTES bytes of value ``i``)."""

    info = SimpleNamespace(block_size=BS, block_nbytes=NBYTES)
    kv = KVSides()

    async def read(self, block_ids: list[int]) -> bytes:
        return b"".join(bytes([i]) * NBYTES for i in block_ids)


def fake_decode_node(monkeypatch, **call_options) -> list[FakeCall]:
    """The TransferKV calls the shipper makes from now on, each answered by a FakeCall."""
    calls: list[FakeCall] = []

    class Stub:
        def __init__(self, channel) -> None:
            pass

        def TransferKV(self, requests, timeout=None, metadata=None):
            calls.append(FakeCall(requests, **call_options))
            return calls[-1]

    monkeypatch.setattr(shipper_module.nodes_pb2_grpc, "DecodeNodeServiceStub", Stub)
    return calls


def ship(prompt: list[int], ids: list[int], monkeypatch, **call_options):
    calls = fake_decode_node(monkeypatch, **call_options)
    shipper = KVShipper(FakeEngine(), ROOT, 30.0, SimpleNamespace(get=lambda a: None), Counter())
    hashes = hash_request_tokens(prompt, BS, ROOT)
    request = nodes_pb2.PrefillRequest(request_id="r1", decode_address="d:1", cache_salt="")

    async def main():
        return await shipper.ship(request, prompt, hashes, ids, first_token=7, timeout=5.0)

    try:
        return asyncio.run(main()), shipper, calls[0]
    except ShipError as exc:
        return exc, shipper, calls[0]


def test_only_the_missing_blocks_and_the_tail_are_sent(monkeypatch):
    prompt = list(range(3 * BS + 5))  # 3 full blocks and a tail
    shipped, shipper, call = ship(prompt, [11, 12, 13, 14], monkeypatch, missing=[0, 2])
    assert shipped == (2, 1, 3 * NBYTES, "grpc")  # blocks 0 and 2 and the tail; 1 reused
    header = call.received[0].header
    assert header.request_id == "r1" and header.first_token_id == 7
    assert list(header.block_hashes) == hash_request_tokens(prompt, BS, ROOT)[:3]
    assert header.transfer_path == "" and header.model_root_hash == ROOT
    blocks = [m.blocks for m in call.received[1:] if m.HasField("blocks")]
    metas = [msgpack.unpackb(b.meta) for b in blocks]
    assert [(m["indices"], m["tail"]) for m in metas] == [([0, 2], False), ([-1], True)]
    assert blocks[0].data == bytes([11]) * NBYTES + bytes([13]) * NBYTES
    assert blocks[1].data == bytes([14]) * NBYTES
    assert call.received[-1].HasField("end")
    c = shipper.counters
    assert (c[names.BLOCKS_SHIPPED], c[names.BLOCKS_REUSED_ON_DECODE]) == (2, 1)
    assert c[names.BYTES_SHIPPED] == 3 * NBYTES and c[names.TRANSFERS_FAILED] == 0


def test_a_decode_node_holding_every_full_block_gets_only_the_end(monkeypatch):
    prompt = list(range(2 * BS))  # no tail
    shipped, _, call = ship(prompt, [5, 6], monkeypatch, missing=[])
    assert shipped == (0, 2, 0, "grpc")
    assert [m.WhichOneof("kind") for m in call.received] == ["header", "end"]


@pytest.mark.parametrize(
    ("options", "code"),
    [
        (dict(answer=False), Failure.UNAVAILABLE),  # closed before answering
        (dict(confirm=False), Failure.INTERNAL),  # never confirmed
    ],
)
def test_a_decode_node_that_breaks_off_is_a_ship_error(monkeypatch, options, code):
    error, shipper, call = ship(list(range(BS + 1)), [3, 4], monkeypatch, missing=[0], **options)
    assert isinstance(error, ShipError) and error.code == code
    assert "decode node d:1" in error.message
    assert call.cancelled and shipper.counters[names.TRANSFERS_FAILED] == 1


# ------------------------------------------------------------------ a real engine


def test_the_blocks_shipped_are_those_the_first_output_names(tmp_path, monkeypatch):
    """A prompt prefilled by a real engine (a LocalEngine without transfer paths: gRPC bytes):
    its first output names its full blocks' hashes and every block it holds; the shipper sends
    those the decode node lacks and the tail, with the engine's bytes of them."""
    config, model = load_model(write_random_checkpoint(tmp_path / "m", seed=3))
    rc = RunnerConfig(
        block_size=BS, kv_cache_bytes=32 * BS * config.kv_bytes_per_token(torch.float32)
    )
    identity = ModelIdentity("m", block_size=BS)
    core = LLMEngine(ModelRunner(config, model, rc), identity, prefill_only=True)
    prompt = [random.randrange(config.vocab_size) for _ in range(3 * BS + 5)]
    calls = fake_decode_node(monkeypatch, missing=[1, 2])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        engine = LocalEngine(core)
        engine.start()
        try:
            spec = KVSpec(role="prefill", address="p:1", paths=("grpc",), host="127.0.0.1")
            assert not (await engine.open_kv(spec)).opened(TX)  # no sender: bytes
            queue = engine.subscribe("r1")
            await engine.add_request("r1", prompt, params, None)
            out = await queue.get()
            facts = out.facts
            assert facts is not None and facts.num_cached_tokens == 0
            assert facts.block_hashes == hash_request_tokens(prompt, BS, identity.root_hash)
            assert facts.block_ids is not None and len(facts.block_ids) == 4  # 3 full, the tail
            shipper = KVShipper(
                engine, identity.root_hash, 30.0, SimpleNamespace(get=lambda a: None), Counter()
            )
            request = nodes_pb2.PrefillRequest(request_id="r1", decode_address="d:1")
            shipped = await shipper.ship(
                request, prompt, facts.block_hashes, facts.block_ids, out.new_token_id, 5.0
            )
            ids = facts.block_ids
            return shipped, await engine.read(ids[1:3]), await engine.read(ids[3:])
        finally:
            await engine.abort("r1")
            await engine.stop()

    shipped, full, tail = asyncio.run(main())
    nbytes = core.kv_port.block_nbytes
    assert shipped == (2, 1, 3 * nbytes, "grpc")
    (call,) = calls
    header = call.received[0].header
    assert header.request_id == "r1" and list(header.prompt_token_ids) == prompt
    assert list(header.block_hashes) == hash_request_tokens(prompt, BS, identity.root_hash)
    assert header.sender_id == "" and header.block_nbytes == nbytes
    blocks = [m.blocks for m in call.received[1:] if m.HasField("blocks")]
    metas = [msgpack.unpackb(b.meta) for b in blocks]
    assert [(m["indices"], m["tail"]) for m in metas] == [([1, 2], False), ([-1], True)]
    assert [b.data for b in blocks] == [full, tail]
    assert len(full) == 2 * nbytes and any(full)  # the prompt's KV, not an empty block
    assert not core.held and core.pool.num_free_blocks == core.kv_port.num_usable_blocks
