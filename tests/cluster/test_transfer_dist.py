"""The dist path over gloo between this process (the receiver) and spawned sender processes:
byte-exact transfers, out-of-order completion, dropped data, tickets, reconnects, and senders
killed or stalled mid-transfer, and a sender that falls back to grpc when no gloo pair can be built
(transfer/dist*.py)."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
from support import transfer_common
from support.kv_pools import SenderProcess, fill_pool, make_pool
from support.transfer_common import RECEIVER_SEED, SENDER_SEED, SPEC, u8

from splitserve.transfer import (
    DIST,
    GRPC,
    TCP,
    ChannelClosed,
    DistAddress,
    NotConnected,
    PeerLost,
    Ticket,
    TransferError,
    TransferTimeout,
    choose_path,
    local_endpoint,
    open_receiver,
    open_sender,
)
from splitserve.transfer.reservation import block_nbytes

SOURCE = fill_pool(make_pool(**SPEC), SENDER_SEED)  # what every sender process holds


@pytest.fixture(scope="module")
def cluster():
    """One receiver in this process; three sender processes, started together."""
    pool = fill_pool(make_pool(**SPEC), RECEIVER_SEED)
    # (dist and tcp: as a node by default; nixl, when installed, would be taken first)
    rx = open_receiver(pool, "decode-0", paths=(DIST, TCP), host="127.0.0.1", connect_timeout=60.0)
    senders = {
        name: SenderProcess(name, SPEC, SENDER_SEED, connect_timeout=60.0)
        for name in ("prefill-0", "prefill-doomed", "prefill-stalled")
    }
    try:
        for sender in senders.values():
            sender.wait_ready()
            assert sender.call("connect", rx.endpoint().to_bytes()) == DIST
        yield rx, pool, senders
    finally:
        for sender in senders.values():
            sender.stop()
        rx.shutdown()


def ship(rx, sender, src, dst, timeout=10.0):
    return transfer_common.ship(rx, sender, src, dst, DIST, timeout)


def test_gloo_ships_blocks_byte_exact(cluster):
    rx, pool, senders = cluster
    before = pool.clone()
    src, dst = [7, 1, 12, 3, 1], [20, 2, 9, 15, 5]
    res, nbytes = ship(rx, senders["prefill-0"], src, dst)
    assert res.state == "done" and nbytes == len(src) * block_nbytes(pool)
    assert torch.equal(u8(pool[dst]), u8(SOURCE[src]))
    rest = [i for i in range(SPEC["num_blocks"]) if i not in dst]
    assert torch.equal(u8(pool[rest]), u8(before[rest]))
    assert "prefill-0" in rx.peers()


def test_gloo_transfers_complete_out_of_order(cluster):
    """Two reservations; the sender fills the second first. One receive() call takes whatever
    arrives and completes the reservation it names."""
    rx, pool, senders = cluster
    sender = senders["prefill-0"]
    first = rx.reserve(sender.node_id, [1, 2], DIST)
    second = rx.reserve(sender.node_id, [3, 4, 6], DIST)
    sender.request("send", second.ticket.to_bytes(), [10, 11, 12], 10.0)
    sender.request("send", first.ticket.to_bytes(), [13, 14], 10.0)
    rx.receive(first, 10.0)
    rx.receive(second, 10.0)
    sender.reply(), sender.reply()
    assert torch.equal(u8(pool[[1, 2]]), u8(SOURCE[[13, 14]]))
    assert torch.equal(u8(pool[[3, 4, 6]]), u8(SOURCE[[10, 11, 12]]))


def test_gloo_data_for_a_cancelled_reservation_is_dropped(cluster):
    rx, pool, senders = cluster
    sender = senders["prefill-0"]
    before = pool.clone()
    dropped = rx.reserve(sender.node_id, [8, 10], DIST)
    kept = rx.reserve(sender.node_id, [11], DIST)
    rx.cancel(dropped)
    sender.request("send", dropped.ticket.to_bytes(), [2, 3], 10.0)
    sender.request("send", kept.ticket.to_bytes(), [4], 10.0)
    rx.receive(kept, 10.0)
    sender.reply(), sender.reply()
    assert torch.equal(u8(pool[[8, 10]]), u8(before[[8, 10]]))
    assert torch.equal(u8(pool[11]), u8(SOURCE[4]))
    with pytest.raises(TransferError):
        dropped.result()


def test_sender_checks_its_ticket(cluster):
    rx, _, senders = cluster
    sender = senders["prefill-0"]
    res = rx.reserve(sender.node_id, [12, 13], DIST)
    sender.request("send", res.ticket.to_bytes(), [1], 5.0)  # one block for two
    status, message = sender.reply_raw()
    assert status == "error" and message.startswith("ValueError")
    theirs = rx.reserve(sender.node_id, [12], DIST).ticket
    foreign = Ticket(DIST, theirs.receiver_id, "someone-else", (12,), theirs.gen, theirs.seq)
    sender.request("send", foreign.to_bytes(), [1], 5.0)
    status, message = sender.reply_raw()
    assert status == "error" and message.startswith("ValueError")
    rx.cancel(res)


def test_close_tears_the_pair_down_and_connect_rebuilds_it(cluster):
    rx, pool, senders = cluster
    sender = senders["prefill-0"]
    stale = rx.reserve(sender.node_id, [14], DIST)
    rx.close(sender.node_id)
    assert stale.state == "failed" and isinstance(stale.error, ChannelClosed)
    assert sender.node_id not in rx.peers()
    with pytest.raises(NotConnected):
        rx.reserve(sender.node_id, [14], DIST)
    # The receiver reports NotConnected through the services; the sender reconnects.
    sender.call("close", "decode-0")
    assert sender.call("connect", rx.endpoint().to_bytes()) == DIST
    sender.request("send", stale.ticket.to_bytes(), [5], 5.0)  # an older generation's ticket
    status, message = sender.reply_raw()
    assert status == "error" and message.startswith("ChannelClosed")
    ship(rx, sender, [6], [14])
    assert torch.equal(u8(pool[14]), u8(SOURCE[6]))


def test_sender_follows_a_restarted_receiver(cluster):
    """A receiver that restarted (same node id, new endpoint) gets a new pair; so does the
    original one afterwards (its old channel for this sender is replaced)."""
    rx, pool, senders = cluster
    sender = senders["prefill-0"]
    pool2 = fill_pool(make_pool(**SPEC), RECEIVER_SEED + 1)
    rx2 = open_receiver(
        pool2, "decode-0", paths=(DIST, TCP), host="127.0.0.1", connect_timeout=60.0
    )
    try:
        assert sender.call("connect", rx2.endpoint().to_bytes()) == DIST
        ship(rx2, sender, [2, 3], [7, 8])
        assert torch.equal(u8(pool2[[7, 8]]), u8(SOURCE[[2, 3]]))
    finally:
        rx2.shutdown()
    assert sender.call("connect", rx.endpoint().to_bytes()) == DIST
    ship(rx, sender, [4], [22])
    assert torch.equal(u8(pool[22]), u8(SOURCE[4]))


def test_killed_sender_leaves_the_pool_intact(cluster):
    rx, pool, senders = cluster
    doomed = senders["prefill-doomed"]
    before = pool.clone()
    res = rx.reserve(doomed.node_id, [16, 17, 18], DIST)
    doomed.request("send_header_then", res.ticket.to_bytes(), [1, 2, 3], "kill")
    assert doomed.reply() == "sending the header"
    with pytest.raises(PeerLost):
        rx.receive(res, 10.0)
    assert res.state == "failed"
    assert torch.equal(u8(pool), u8(before))
    assert doomed.node_id not in rx.peers()
    doomed.proc.join(10)
    assert not doomed.proc.is_alive()
    # Other pairs are unaffected.
    ship(rx, senders["prefill-0"], [9], [16])
    assert torch.equal(u8(pool[16]), u8(SOURCE[9]))


def test_stalled_sender_times_out_and_leaves_the_pool_intact(cluster):
    rx, pool, senders = cluster
    stalled = senders["prefill-stalled"]
    before = pool.clone()
    res = rx.reserve(stalled.node_id, [19, 21], DIST)
    stalled.request("send_header_then", res.ticket.to_bytes(), [1, 2], "stop")
    assert stalled.reply() == "sending the header"
    with pytest.raises(TransferTimeout):
        rx.receive(res, 1.5)
    assert res.state == "failed" and isinstance(res.error, TransferTimeout)
    assert torch.equal(u8(pool), u8(before))
    assert stalled.node_id not in rx.peers()
    stalled.kill()


def test_sender_falls_back_to_grpc_when_no_pair_can_be_built():
    pool = make_pool(**SPEC)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = dataclasses.replace(
        local_endpoint("decode-x", pool), dist=DistAddress("127.0.0.1", port, "gloo")
    )
    tx = open_sender(pool, "prefill-x", connect_timeout=0.5)
    assert choose_path(tx.endpoint(), peer) == DIST
    assert tx.connect(peer) == GRPC
    assert tx.path("decode-x") == GRPC
    with pytest.raises(ValueError):
        tx.send(Ticket(GRPC, "decode-x", "prefill-x", (1,)), [1], timeout=1.0)
