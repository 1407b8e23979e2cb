"""KVInbox (decode_node/receiver.py) on its own, with a fake engine (the ``NodeEngine`` commands
it uses, its transfer receiver behind them): a transfer of blocks another transfer is receiving
waits for it (up to its deadline); reserving waits for freed blocks while the pool is short and
refuses at once a prompt larger than the node; quarantined blocks are freed only after their
grace; a ticket for another node's endpoint falls back to the byte path; a released transfer
cancels its reservation and frees its blocks even when its call is cancelled meanwhile. The
TransferKV calls through it are in tests/cluster/test_decode_transfer.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from splitserve.decode_node.header import TransferRefused
from splitserve.decode_node.pending import Pending, PendingTable
from splitserve.decode_node.receiver import KVInbox, Transfer
from splitserve.engine.api import RX, KVSides, Reserved, ResInfo
from splitserve.kvstore import ModelIdentity
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime import counter_names as names
from splitserve.runtime.failure import Failure


class FakeEngine:
    """The ``NodeEngine`` commands the inbox uses: the pool's (``reserve``, ``free``) and the
    receiver's (``rx_reserve``, ``rx_cancel``), answered at once."""

    info = SimpleNamespace(block_size=16, num_usable_blocks=8, block_nbytes=64)

    def __init__(self, free_after: int = 0, grace_s: float = 0.0, endpoint=b"endpoint") -> None:
        self.kv = KVSides(rx_id="decode-0", rx_paths=("tcp", "grpc"), rx_endpoint=endpoint)
        self.short = free_after  # reserve answers None this many times (the pool is short)
        self.grace_s = grace_s  # what rx_cancel answers
        self.freed: list[str] = []
        self.reserved: list[tuple] = []  # rx_reserve's (sender, dest, path)
        self.cancelled: list[int] = []  # rx_cancel's reservation ids
        self.cancel_gate: asyncio.Event | None = None  # rx_cancel waits for it, if set
        self.reserve_gate: asyncio.Event | None = None  # rx_reserve waits for it, if set

    async def reserve(self, rid, hashes, prompt_len):
        if self.short:
            self.short -= 1
            return None
        tail = prompt_len % self.info.block_size != 0
        return Reserved(list(range(len(hashes))), tail, list(range(10, 10 + len(hashes) + tail)))

    async def free(self, rid):
        self.freed.append(rid)

    async def holds(self, rid):
        return False

    async def rx_reserve(self, side, sender_id, dest, path):
        assert side == RX
        if self.reserve_gate is not None:
            await self.reserve_gate.wait()
        self.reserved.append((sender_id, tuple(dest), path))
        return ResInfo(
            res_id=len(self.reserved),
            path=path,
            caller_writes=not path,
            receive_first=False,
            ticket=path.encode(),
            nbytes=64 * len(dest),
            num_blocks=len(dest),
        )

    async def rx_cancel(self, side, res_id):
        assert side == RX
        if self.cancel_gate is not None:
            await self.cancel_gate.wait()
        self.cancelled.append(res_id)
        return self.grace_s


def inbox(engine: FakeEngine | None = None) -> tuple[KVInbox, FakeEngine]:
    engine = engine or FakeEngine()
    box = KVInbox(engine, ModelIdentity("m"), PendingTable(), Counter())  # a fake NodeEngine
    return box, engine


def test_the_engines_receiver_endpoint_and_id_are_offered():
    box, _ = inbox()
    assert (box.endpoint, box.rx_id) == (b"endpoint", "decode-0")
    assert inbox(FakeEngine(endpoint=b""))[0].endpoint == b""  # the byte path only


def test_an_id_in_transfer_pending_or_in_the_engine_is_in_use():
    box, _ = inbox()
    assert not box.in_use("r")
    box.live.add("r")  # a relay stream's decode or generate command added it to the engine
    assert box.in_use("r")
    box.live.discard("r")
    box.in_transfer.add("r")
    assert box.in_use("r")
    box.in_transfer.discard("r")
    box.pending.add("r", Pending([1], 3, SamplingParams(), None, time.monotonic() + 30))
    assert box.in_use("r")


def test_a_transfer_of_blocks_another_is_receiving_waits_for_it_and_counts_once():
    async def main():
        box, _ = inbox()
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
        box, _ = inbox()
        box.receiving[b"h1"] = asyncio.get_running_loop().create_future()  # never done
        with pytest.raises(TransferRefused) as refused:
            await box.wait_for_receiving([b"h1"], deadline=time.monotonic() + 0.05)
        assert refused.value.code == Failure.DEADLINE

    asyncio.run(main())


def test_a_prompt_larger_than_the_node_is_refused_at_once():
    async def main():
        box, _ = inbox()
        hashes = [bytes([i]) for i in range(8)]  # 8 full blocks and a partial one: 9 > 8
        with pytest.raises(TransferRefused) as refused:
            await box.reserve_blocks("r", hashes, 8 * 16 + 3, deadline=None)
        assert refused.value.code == Failure.REFUSED
        assert "needs 9 KV blocks" in str(refused.value)

    asyncio.run(main())


def test_a_short_pool_waits_for_freed_blocks_then_reserves():
    async def main():
        box, _ = inbox(FakeEngine(free_after=2))
        reserved = await box.reserve_blocks("r", [b"a", b"b"], 40, deadline=None)
        assert reserved == Reserved([0, 1], True, [10, 11, 12])
        assert box.counters[names.TRANSFERS_WAITED_FOR_BLOCKS] == 1

    asyncio.run(main())


def test_a_short_pool_past_the_deadline_is_refused():
    async def main():
        box, _ = inbox(FakeEngine(free_after=10**6))
        with pytest.raises(TransferRefused) as refused:
            await box.reserve_blocks("r", [b"a"], 16, deadline=time.monotonic() + 0.1)
        assert refused.value.code == Failure.REFUSED

    asyncio.run(main())


def test_quarantined_blocks_are_freed_only_after_the_grace():
    async def main():
        box, engine = inbox()
        started = time.monotonic()
        box.quarantine("r", num_blocks=3, grace_s=0.3)
        assert box.counters[names.IPC_BLOCKS_QUARANTINED] == 3
        while not engine.freed and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        assert engine.freed == ["r"] and time.monotonic() - started >= 0.3

    asyncio.run(main())


def test_a_ticket_for_another_nodes_endpoint_falls_back_to_bytes():
    async def main():
        box, engine = inbox()
        header = SimpleNamespace(transfer_path="tcp", receiver_id="decode-old", sender_id="p0")
        assert (await box.reserve_in_layer(header, [3, 4])).path == ""
        assert box.counters[names.TRANSFERS_DECLINED_STALE_ENDPOINT] == 1
        mine = SimpleNamespace(transfer_path="tcp", receiver_id="decode-0", sender_id="p0")
        assert (await box.reserve_in_layer(mine, [5])).path == "tcp"
        assert engine.reserved == [("p0", (3, 4), ""), ("p0", (5,), "tcp")]

    asyncio.run(main())


def test_a_path_the_receiver_cannot_serve_falls_back_to_bytes():
    async def main():
        box, engine = inbox()
        refuse = engine.rx_reserve

        async def rx_reserve(side, sender_id, dest, path):
            if path:
                raise ValueError(f"no {path} path here")
            return await refuse(side, sender_id, dest, path)

        engine.rx_reserve = rx_reserve
        mine = SimpleNamespace(transfer_path="dist", receiver_id="decode-0", sender_id="p0")
        res = await box.reserve_in_layer(mine, [5])
        assert (res.path, res.caller_writes, res.ticket) == ("", True, b"")
        assert engine.reserved == [("p0", (5,), "")]

    asyncio.run(main())


def _transfer(box: KVInbox, path: str = "tcp", rid: str = "r", streamed: bool = False) -> Transfer:
    header = SimpleNamespace(
        request_id=rid, block_hashes=[b"h0", b"h1"], transfer_path=path, receiver_id="decode-0",
        sender_id="p0", first_token_at_end=streamed,
    )  # fmt: skip
    box.in_transfer.add(rid)
    return Transfer(box, header, SamplingParams(), list(range(40)))


def test_a_released_transfer_cancels_its_reservation_then_frees_its_blocks():
    async def main():
        box, engine = inbox()
        transfer = _transfer(box)
        await transfer.reserve(None)
        assert transfer.ticket == b"tcp" and not transfer.on_stream and transfer.nbytes == 3 * 64
        assert box.receiving  # its blocks are claimed while it receives them
        await transfer.release()
        assert engine.cancelled == [1] and engine.freed == ["r"]
        assert not box.receiving and "r" not in box.in_transfer
        await transfer.release()  # idempotent
        assert engine.cancelled == [1] and engine.freed == ["r"]

    asyncio.run(main())


def test_a_reservation_that_asks_for_a_grace_quarantines_the_blocks():
    async def main():
        box, engine = inbox(FakeEngine(grace_s=0.05))
        transfer = _transfer(box)
        await transfer.reserve(None)
        await transfer.release()
        assert engine.cancelled == [1] and engine.freed == []  # not before the grace
        assert box.counters[names.IPC_BLOCKS_QUARANTINED] == 3
        await asyncio.sleep(0.2)
        assert engine.freed == ["r"]

    asyncio.run(main())


def test_a_release_cancelled_meanwhile_still_cancels_and_frees():
    """The TransferKV call is cancelled (its client gone) while its release waits for the
    reservation's cancel: the cancel still completes and the blocks are still freed."""

    async def main():
        box, engine = inbox()
        transfer = _transfer(box)
        await transfer.reserve(None)
        engine.cancel_gate = asyncio.Event()
        release = asyncio.create_task(transfer.release())
        await asyncio.sleep(0.01)
        release.cancel()
        await asyncio.sleep(0.01)
        assert not release.done()  # still waiting for the cancel, through the cancellation
        engine.cancel_gate.set()
        with pytest.raises(asyncio.CancelledError):
            await release
        assert engine.cancelled == [1] and engine.freed == ["r"]
        assert not box.receiving and "r" not in box.in_transfer

    asyncio.run(main())


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


def test_a_transfer_cancelled_while_the_layer_reserves_still_cancels_the_reservation():
    """The reservation is made where the engine lives: a call cancelled while it is being made
    keeps it, so that its release cancels it rather than leave it behind there."""

    async def main():
        box, engine = inbox()
        transfer = _transfer(box)
        engine.reserve_gate = asyncio.Event()

        async def call():
            try:
                await transfer.reserve(None)
            finally:
                await transfer.release()

        task = asyncio.create_task(call())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done()
        engine.reserve_gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transfer.res is not None and engine.cancelled == [transfer.res.res_id]
        assert engine.freed == ["r"] and not box.receiving

    asyncio.run(main())


def test_a_streamed_transfer_neither_waits_for_nor_holds_up_one_of_the_same_prefix():
    """A streamed transfer is reserved before its prefill runs and ends only with it: a second
    prompt of the same prefix must not wait in its handshake for the first one's prefill (nor
    the first for a transfer in flight). Each reserves its own blocks; the engine keeps the
    first registered copy of a hash."""

    async def main():
        box, engine = inbox()
        receiving = _transfer(box, rid="plain")  # an ordinary transfer of the same blocks
        await receiving.reserve(None)
        assert set(box.receiving) == {b"h0", b"h1"}
        first = _transfer(box, rid="s1", streamed=True)
        await asyncio.wait_for(first.reserve(None), 1)  # does not wait for "plain"
        second = _transfer(box, rid="s2", streamed=True)
        await asyncio.wait_for(second.reserve(None), 1)  # nor for "s1"
        assert first.missing == second.missing == [0, 1]
        assert box.counters[names.TRANSFERS_WAITED_FOR_SAME_BLOCKS] == 0
        await receiving.release()
        assert not box.receiving  # the streamed ones claimed nothing
        for transfer in (first, second):
            await transfer.release()
        assert sorted(engine.freed) == ["plain", "s1", "s2"]

    asyncio.run(main())
