"""KVInbox (decode_node/receiver.py) on its own, with a fake engine and receiver: a transfer of
blocks another transfer is receiving waits for it (up to its deadline); reserving waits for freed
blocks while the pool is short and refuses at once a prompt larger than the node; quarantined
blocks are freed only after their grace; a ticket for another node's endpoint falls back to the
byte path. The TransferKV calls through it are in tests/cluster/test_decode_transfer.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import grpc
import pytest

from splitserve.decode_node.header import TransferRefused
from splitserve.decode_node.pending import Pending, PendingTable
from splitserve.decode_node.receiver import KVInbox
from splitserve.kvstore import ModelIdentity
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime import counter_names as names


class FakePort:
    block_size = 16
    num_usable_blocks = 8

    def __init__(self, free_after: int = 0) -> None:
        self.short = free_after  # reserve answers None this many times (the pool is short)
        self.freed: list[str] = []

    def reserve(self, rid, hashes, prompt_len):
        if self.short:
            self.short -= 1
            return None
        return ("reserved", rid, len(hashes))

    def free(self, rid):
        self.freed.append(rid)


class FakeEngine:
    def __init__(self, port: FakePort) -> None:
        self.kv_port = port
        self.engine = SimpleNamespace(requests={})

    async def call_to_end(self, fn, *args):
        return fn(*args)


class FakeReceiver:
    node_id = "decode-0"
    paths = ("tcp",)

    def __init__(self) -> None:
        self.reserved: list[tuple] = []

    def endpoint(self):
        return SimpleNamespace(to_bytes=lambda: b"endpoint")

    def reserve(self, sender_id, dest, path):
        self.reserved.append((sender_id, tuple(dest), path))
        return path


def inbox(port: FakePort | None = None) -> tuple[KVInbox, FakePort, FakeReceiver]:
    port = port or FakePort()
    rx = FakeReceiver()
    box = KVInbox(FakeEngine(port), rx, ModelIdentity("m"), PendingTable(), Counter())
    return box, port, rx


def test_the_endpoint_is_offered_only_with_a_path_besides_bytes():
    box, _, _ = inbox()
    assert box.endpoint == b"endpoint"
    FakeReceiver.paths = ()
    try:
        assert inbox()[0].endpoint == b""
    finally:
        FakeReceiver.paths = ("tcp",)


def test_a_transfer_of_blocks_another_is_receiving_waits_for_it_and_counts_once():
    async def main():
        box, _, _ = inbox()
        first = asyncio.get_running_loop().create_future()
        box.receiving[b"h1"] = first
        await box.wait_for_receiving([b"h0"], deadline=None)  # nothing shared: no wait
        assert box.counters[names.TRANSFERS_WAITED_FOR_SAME_BLOCKS] == 0
        waiter = asyncio.create_task(box.wait_for_receiving([b"h0", b"h1"], deadline=None))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        del box.receiving[b"h1"]
        first.set_result(None)
        await asyncio.wait_for(waiter, 1)
        assert box.counters[names.TRANSFERS_WAITED_FOR_SAME_BLOCKS] == 1

    asyncio.run(main())


def test_waiting_for_the_same_blocks_ends_at_the_deadline():
    async def main():
        box, _, _ = inbox()
        box.receiving[b"h1"] = asyncio.get_running_loop().create_future()  # never done
        with pytest.raises(TransferRefused) as refused:
            await box.wait_for_receiving([b"h1"], deadline=time.monotonic() + 0.05)
        assert refused.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(main())


def test_a_prompt_larger_than_the_node_is_refused_at_once():
    async def main():
        box, _, _ = inbox()
        hashes = [bytes([i]) for i in range(8)]  # 8 full blocks and a partial one: 9 > 8
        with pytest.raises(TransferRefused) as refused:
            await box.reserve_blocks("r", hashes, 8 * 16 + 3, deadline=None)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "needs 9 KV blocks" in str(refused.value)

    asyncio.run(main())


def test_a_short_pool_waits_for_freed_blocks_then_reserves():
    async def main():
        box, _, _ = inbox(FakePort(free_after=2))
        reserved = await box.reserve_blocks("r", [b"a", b"b"], 40, deadline=None)
        assert reserved == ("reserved", "r", 2)
        assert box.counters[names.TRANSFERS_WAITED_FOR_BLOCKS] == 1

    asyncio.run(main())


def test_a_short_pool_past_the_deadline_is_refused():
    async def main():
        box, _, _ = inbox(FakePort(free_after=10**6))
        with pytest.raises(TransferRefused) as refused:
            await box.reserve_blocks("r", [b"a"], 16, deadline=time.monotonic() + 0.1)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(main())


def test_quarantined_blocks_are_freed_only_after_the_grace():
    async def main():
        box, port, _ = inbox()
        started = time.monotonic()
        box.quarantine("r", num_blocks=3, grace_s=0.3)
        assert box.counters[names.IPC_BLOCKS_QUARANTINED] == 3
        while not port.freed and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        assert port.freed == ["r"] and time.monotonic() - started >= 0.3

    asyncio.run(main())


def test_a_ticket_for_another_nodes_endpoint_falls_back_to_bytes():
    box, _, rx = inbox()
    header = SimpleNamespace(transfer_path="tcp", receiver_id="decode-old", sender_id="p0")
    assert box.reserve_in_layer(header, [3, 4]) == ""
    assert box.counters[names.TRANSFERS_DECLINED_STALE_ENDPOINT] == 1
    mine = SimpleNamespace(transfer_path="tcp", receiver_id="decode-0", sender_id="p0")
    assert box.reserve_in_layer(mine, [5]) == "tcp"
    assert rx.reserved == [("p0", (3, 4), ""), ("p0", (5,), "tcp")]


def test_a_release_before_the_transfer_lands_frees_it_at_the_next_poll():
    """The router gave up on the request while P was still shipping: D's Release found nothing;
    the KV adopted after it expires at once rather than at its transfer deadline."""
    table = PendingTable()
    assert table.release("r-1") is None  # nothing yet: remembered
    far = time.monotonic() + 30
    table.add("r-1", Pending([1, 2], 3, SamplingParams(), None, far))
    table.add("r-2", Pending([1, 2], 3, SamplingParams(), None, far))
    assert table.take_expired(time.monotonic()) == ["r-1"]
    assert "r-2" in table and table.release("r-2") is not None and len(table) == 0


def test_a_draining_node_holds_adopted_requests_briefly():
    """Requests whose Decode call may never come (their client gone) do not hold a drain for
    the transfer deadline: a few seconds, for those adopted before and during the drain."""
    table = PendingTable()
    far = time.monotonic() + 30
    table.add("before", Pending([1], 3, SamplingParams(), None, far))
    table.hold_at_most(0.05)
    table.add("during", Pending([1], 3, SamplingParams(), None, far))
    assert table.take_expired(time.monotonic()) == []
    time.sleep(0.06)
    assert sorted(table.take_expired(time.monotonic())) == ["before", "during"]
