"""Peer prefix fetches between prefill services in one process, each over its own engine
(``LocalEngine``, its transfer sides opened as a node opens them) behind a loopback gRPC server:
the asker reserves blocks and a reservation of its engine's receiver, the holder pins its run and
sends it with its engine's fetch sender over tcp; an asker without the layer fetches gRPC bytes.
Either way the asker's cached blocks hold the holder's bytes, it computes only the rest, and
nothing stays reserved, pinned or held. Between node processes: tests/cluster/test_peer_fetch.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest
import torch

from splitserve.engine.api import FETCH_TX, RX, TX, KVSpec
from splitserve.engine.core import LLMEngine
from splitserve.engine.local import FETCH_RECEIVER_MARK, LocalEngine
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.tiny import write_random_checkpoint
from splitserve.prefill_node.service import PrefillService
from splitserve.runtime import counter_names as names
from splitserve.runtime.server import SERVER_OPTIONS
from splitserve.transfer import Endpoint, Ticket
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

BS = 16
IDENTITY = ModelIdentity("m", block_size=BS)
NUM_BLOCKS = 64
LAYER = ("grpc", "tcp")  # what a CPU node's --kv-transfer leaves it
BYTES = ("grpc",)  # --kv-transfer none


class Node:
    """A prefill service over its own engine, served on a loopback port."""

    def __init__(self, model, paths: tuple[str, ...]) -> None:
        config, weights = model
        kv_bytes = NUM_BLOCKS * BS * config.kv_bytes_per_token(torch.float32)
        runner = ModelRunner(config, weights, RunnerConfig(block_size=BS, kv_cache_bytes=kv_bytes))
        self.core = LLMEngine(runner, IDENTITY, prefill_only=True)
        self.paths = paths

    async def start(self) -> Node:
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.engine = LocalEngine(self.core)
        self.engine.start()
        spec = KVSpec(role="prefill", address=self.address, paths=self.paths, host="127.0.0.1")
        await self.engine.open_kv(spec)
        self.service = PrefillService(self.engine, IDENTITY, deadline_s=5.0)
        nodes_pb2_grpc.add_PrefillNodeServiceServicer_to_server(self.service, self.server)
        nodes_pb2_grpc.add_NodeStatsServiceServicer_to_server(self.service, self.server)
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(None)
        await self.service.close()
        await self.engine.stop()

    async def prefill(self, rid: str, prompt: list[int], **hint) -> nodes_pb2.PrefillResponse:
        """A prompt that ends at its first token (nothing to ship)."""
        async with grpc.aio.insecure_channel(self.address) as channel:
            return await nodes_pb2_grpc.PrefillNodeServiceStub(channel).Prefill(
                nodes_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1),
                    decode_address="127.0.0.1:1",  # never reached
                    **hint,
                ),
                timeout=30,
            )

    async def cached(self, prompt: list[int], n: int) -> bytes:
        """The bytes of the prompt's first ``n`` blocks, which must be cached here."""
        hashes = hash_request_tokens(prompt, BS, IDENTITY.root_hash)[:n]
        pinned = await self.engine.pin(hashes)
        try:
            assert len(pinned.block_ids) == n
            return await self.engine.read(pinned.block_ids)
        finally:
            await self.engine.unpin(pinned.pin_id)

    def idle(self) -> bool:
        """Nothing reserved, pinned or held (cached blocks count as free)."""
        engine = self.engine
        return (
            not engine._reservations
            and not engine._pins
            and not self.core.held
            and self.core.pool.num_free_blocks == self.core.kv_port.num_usable_blocks
        )


def _run(model, askers: tuple[tuple[str, ...], ...]) -> None:
    prompt = [random.randrange(model[0].vocab_size) for _ in range(5 * BS + 3)]
    full = (len(prompt) - 1) // BS  # the blocks before the last token: what may be fetched

    async def main():
        holder = await Node(model, LAYER).start()
        nodes = [holder]
        try:
            kv = holder.engine.kv
            assert kv.opened(TX) and kv.opened(FETCH_TX) and kv.opened(RX)
            assert FETCH_RECEIVER_MARK in kv.rx_id and kv.fetch_paths == ("tcp",)
            first = await holder.prefill("h", prompt)
            assert first.cached_tokens == 0 and first.finish_reason == "length"
            want = await holder.cached(prompt, full)
            served = served_tcp = 0
            for i, paths in enumerate(askers):
                asker = await Node(model, paths).start()
                nodes.append(asker)
                got = await asker.prefill(
                    f"a{i}", prompt, peer_address=holder.address, peer_blocks=6
                )
                assert got.blocks_fetched == full and got.cached_tokens == full * BS
                assert got.first_token_id == first.first_token_id
                assert await asker.cached(prompt, full) == want
                theirs, mine = asker.service.counters, holder.service.counters
                assert theirs[names.PREFIX_BLOCKS_FETCHED] == full
                assert theirs[names.PREFIX_FETCH_FAILED] == 0
                layer = "tcp" in paths
                assert theirs[names.prefix_fetches_via("tcp")] == int(layer)
                served += full
                served_tcp += full if layer else 0
                assert mine[names.BLOCKS_SERVED_TO_PEERS] == served
                assert mine[names.blocks_served_to_peers_via("tcp")] == served_tcp
            for node in nodes:
                assert node.idle()
        finally:
            for node in reversed(nodes):
                await node.stop()

    asyncio.run(main())


async def _until(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _model(tmp_path):
    return load_model(write_random_checkpoint(tmp_path / "m", seed=7))


def test_a_prefix_is_fetched_through_the_engines_transfer_sides(tmp_path):
    _run(_model(tmp_path), (LAYER,))


def test_an_asker_without_the_layer_fetches_bytes(tmp_path):
    _run(_model(tmp_path), (BYTES,))


def test_an_asker_cancelled_mid_fetch_releases_its_reservation(tmp_path):
    """The asker's call is cancelled while the holder is sending: its reservation (blocks and
    the receiver's) is released however the cancel lands, the holder unpins once its send is
    over, and the next fetch of the prefix goes through."""
    model = _model(tmp_path)
    prompt = [random.randrange(model[0].vocab_size) for _ in range(5 * BS + 3)]
    full = (len(prompt) - 1) // BS

    async def main():
        holder = await Node(model, LAYER).start()
        asker = None
        try:
            asker = await Node(model, LAYER).start()
            await holder.prefill("h", prompt)
            sending, go = asyncio.Event(), asyncio.Event()
            send = holder.engine.tx_send

            async def held_send(side, ticket, src, timeout):
                sending.set()
                await go.wait()
                return await send(side, ticket, src, timeout)

            holder.engine.tx_send = held_send
            hint = dict(peer_address=holder.address, peer_blocks=6)
            call = asyncio.ensure_future(asker.prefill("a", prompt, **hint))
            await asyncio.wait_for(sending.wait(), 10)
            assert asker.engine._reservations and not asker.idle()  # waiting for the holder
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await _until(asker.idle)
            go.set()
            await _until(holder.idle)
            del holder.engine.tx_send  # the engine's own again
            got = await asker.prefill("b", prompt, **hint)
            assert got.blocks_fetched == full
            assert asker.service.counters[names.prefix_fetches_via("tcp")] == 1
            assert holder.idle() and asker.idle()
        finally:
            if asker is not None:
                await asker.stop()
            await holder.stop()

    asyncio.run(main())


def test_the_holder_declines_a_ticket_that_is_not_for_its_fetch_sender(tmp_path):
    """A ticket for another sender, for a receiver that is not the endpoint's or not a prefill
    node's fetch receiver, over a path that is not a fetch path, or for other blocks than asked
    for: declined (the asker fetches bytes), nothing sent, nothing left pinned."""
    model = _model(tmp_path)
    prompt = [random.randrange(model[0].vocab_size) for _ in range(5 * BS + 3)]
    full = (len(prompt) - 1) // BS

    async def main():
        holder = await Node(model, LAYER).start()
        asker = None
        try:
            asker = await Node(model, LAYER).start()
            await holder.prefill("h", prompt)
            mine = asker.engine.kv.rx_endpoint
            rx = Endpoint.from_bytes(mine)
            not_fetch = dataclasses.replace(rx, node_id=asker.address).to_bytes()
            good = Ticket("tcp", rx.node_id, holder.address, tuple(range(full)), token=b"t" * 16)
            bad = [
                (dataclasses.replace(good, sender_id="10.0.0.9:1"), mine),
                (dataclasses.replace(good, receiver_id=f"{asker.address}#x"), mine),
                (dataclasses.replace(good, receiver_id=asker.address), not_fetch),
                (dataclasses.replace(good, path="ipc"), mine),
                (dataclasses.replace(good, block_ids=tuple(range(full - 1))), mine),
            ]
            async with grpc.aio.insecure_channel(holder.address) as channel:
                stub = nodes_pb2_grpc.PrefillNodeServiceStub(channel)
                for ticket, endpoint in bad:
                    request = nodes_pb2.FetchBlocksRequest(
                        block_hashes=hash_request_tokens(prompt, BS, IDENTITY.root_hash)[:full],
                        model_root_hash=IDENTITY.root_hash,
                        block_nbytes=holder.core.kv_port.block_nbytes,
                        prompt_token_ids=prompt[: full * BS],
                        receiver_endpoint=endpoint,
                        ticket=ticket.to_bytes(),
                    )
                    (answer,) = [m async for m in stub.FetchBlocks(request, timeout=10)]
                    assert (answer.transfer_path, answer.blocks_sent) == ("", 0), ticket
            assert holder.service.counters[names.BLOCKS_SERVED_TO_PEERS] == 0
            assert holder.idle()
        finally:
            if asker is not None:
                await asker.stop()
            await holder.stop()

    asyncio.run(main())
