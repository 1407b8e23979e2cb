"""Cancelled work gives every block back: a router, a prefill and two decode nodes on loopback.

Many calls are cancelled at random moments, many within their first 100 ms: transfers the sender
abandons (half-closed and then cancelled, the way a prefill node gives up on one), decodes whose
Relay stream is cancelled before they answered, and whole requests through the router (in
prefill, in the transfer, while decoding). Afterwards every node's pool is back at its idle free
count (cached blocks count as free) with nothing running or waiting for its decode command, and
the next request succeeds. The prefill node and one decode node schedule asynchronously
(``--async-scheduling on``, a GPU's default: step N+1 launched before step N's tokens are read),
the other decode node synchronously (the CPU's default), so both paths meet every cancellation."""

import asyncio
import contextlib
import json
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.processes import (
    assert_settled,
    idle_free_blocks,
    node_stats,
    start_node,
    start_router,
)
from support.relay import Commands
from support.streams import cancel_at_random_moments

from splitserve.client import Client
from splitserve.kvstore import hash_request_tokens
from splitserve.models.tiny import write_random_checkpoint
from splitserve.transfer.grpc_bytes.codec import encode_blocks
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

BS = 16
# A transfer whose request was cancelled between its prefill and its decode command is freed at
# this deadline; short, so that the pools settle within the test.
# dist: a receiver-driven path, whose cancel frees at once (a sender-writes path, ipc or nixl,
# holds cancelled blocks for a grace: tests/support/transfer_contract.py covers that).
NODE_FLAGS = ("--transfer-deadline-s", "3", "--kv-transfer", "dist")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cancel")
    model = write_random_checkpoint(tmp / "m", seed=5, with_tokenizer=True)
    procs = []
    try:
        with ThreadPoolExecutor(3) as pool:  # the nodes load side by side
            started = [
                pool.submit(start_node, role, model, tmp, *NODE_FLAGS, "--async-scheduling", mode)
                for role, mode in (("prefill", "on"), ("decode", "on"), ("decode", "off"))
            ]
            procs += [f.result() for f in started]
        prefill, decode = procs[:1], procs[1:]
        router = start_router(model, tmp, [p.address for p in prefill], [d.address for d in decode])
        procs.append(router)
        config = json.loads((model / "config.json").read_text())
        kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
        block_nbytes = config["num_hidden_layers"] * 2 * BS * kv_heads * head_dim * 4  # float32
        yield router, [*prefill, *decode], block_nbytes
    finally:
        for proc in reversed(procs):
            proc.stop()


class Sender:
    """Plays a prefill node against one decode node (gRPC bytes)."""

    def __init__(self, channel, root: bytes, block_nbytes: int, rng: random.Random) -> None:
        self.stub = nodes_pb2_grpc.DecodeNodeServiceStub(channel)
        self.root, self.block_nbytes, self.rng = root, block_nbytes, rng

    def header(self, rid: str, n_tokens: int, max_tokens: int) -> nodes_pb2.TransferKVRequest:
        prompt = [self.rng.randrange(256) for _ in range(n_tokens)]
        return nodes_pb2.TransferKVRequest(
            header=nodes_pb2.TransferHeader(
                request_id=rid,
                prompt_token_ids=prompt,
                first_token_id=5,
                block_hashes=hash_request_tokens(prompt, BS, self.root),
                model_root_hash=self.root,
                block_nbytes=self.block_nbytes,
                # A decode whose stream ended before the node read it leaves the request to this
                # deadline.
                deadline_s=2,
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True
                ),
            )
        )

    def blocks(self, indices: list[int], tail: bool = False) -> nodes_pb2.TransferKVRequest:
        data = self.rng.randbytes(len(indices) * self.block_nbytes)
        meta, data = encode_blocks(indices, data, tail)
        return nodes_pb2.TransferKVRequest(blocks=nodes_pb2.BlockData(meta=meta, data=data))

    async def transfer(self, rid: str, n_tokens: int, max_tokens: int) -> None:
        call = self.stub.TransferKV()
        await call.write(self.header(rid, n_tokens, max_tokens))
        missing = list((await call.read()).missing)
        if missing:
            await call.write(self.blocks(missing))
        if n_tokens % BS:
            await call.write(self.blocks([-1], tail=True))
        await call.write(nodes_pb2.TransferKVRequest(end=nodes_pb2.TransferEnd()))
        await call.done_writing()
        assert (await call.read()).done

    async def decode(self, rid: str, cancel_after: float | None = None) -> None:
        """The request on a Relay stream of its own; ``cancel_after``: the stream cancelled
        then (its end ends the request on the node)."""
        commands = Commands(nodes_pb2.RelayCommand(decode=nodes_pb2.DecodeRequest(request_id=rid)))
        call = self.stub.Relay(commands)
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            async for batch in call:
                if any(o.finish_reason or o.error_code for o in batch.outputs):
                    break
        commands.queue.put_nowait(None)
        call.cancel()

    async def abandon(self, rid: str, half_close: bool) -> None:
        """Header, the node's reply, then gone (half-closed first, like a prefill node)."""
        call = self.stub.TransferKV()
        try:
            await call.write(self.header(rid, self.rng.randrange(17, 200), 4))
            await call.read()
            if half_close:
                await call.done_writing()
            await asyncio.sleep(self.rng.uniform(0, 0.01))
        finally:
            call.cancel()


async def abandon_on_a_busy_node(address: str, root: bytes, block_nbytes: int) -> list:
    rng = random.Random(7)
    async with grpc.aio.insecure_channel(address) as channel:
        sender = Sender(channel, root, block_nbytes, rng)

        async def long_decode(i: int) -> None:  # keeps the engine thread stepping
            await sender.transfer(f"busy-{i}", 300, 200)
            await sender.decode(f"busy-{i}")

        async def cancelled_decode(i: int) -> None:
            await sender.transfer(f"cut-{i}", rng.randrange(17, 100), 100)
            await sender.decode(f"cut-{i}", cancel_after=rng.uniform(0, 0.05))

        busy = [asyncio.create_task(long_decode(i)) for i in range(6)]
        await asyncio.sleep(0.5)
        cuts = [abandon_or_cut(sender, cancelled_decode, i) for i in range(120)]
        results = await asyncio.gather(*cuts, return_exceptions=True)
        await asyncio.gather(*busy)
    return results


def abandon_or_cut(sender: Sender, cancelled_decode, i: int):
    return cancelled_decode(i) if i % 3 == 2 else sender.abandon(f"gone-{i}", half_close=i % 3 == 0)


def test_abandoned_transfers_and_cancelled_decodes_free_their_blocks(cluster):
    _, nodes, block_nbytes = cluster
    decode = nodes[1]
    idle = idle_free_blocks([decode])
    root = node_stats(decode).model_root_hash
    results = asyncio.run(abandon_on_a_busy_node(decode.address, root, block_nbytes))
    unexpected = [r for r in results if r is not None and not isinstance(r, grpc.aio.AioRpcError)]
    assert not unexpected, unexpected[:3]
    assert_settled([decode], idle)


def test_streams_cancelled_through_the_router_leave_no_block_held(cluster):
    router, nodes, _ = cluster
    with Client(router.address) as client:  # every node's first steps are slow: warm up
        for _ in range(4):
            client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0.0)
    idle = idle_free_blocks(nodes)

    results = asyncio.run(cancel_at_random_moments(router.address, random.Random(11), 80))
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) >= 40, results
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]

    assert_settled(nodes, idle)
    with Client(router.address) as client:
        result = client.generate(prompt="one more", max_tokens=5, temperature=0.0, ignore_eos=True)
    assert len(result.token_ids) == 5
