"""The tcp path between this process (the receiver) and spawned sender processes: byte-exact
transfers over several connections and chunks, a reservation filled layer range by layer range
(a layer-wise stream's pieces), chunks that are forged, out of range, repeated or corrupted, a
sender killed half-way through a chunk, and the listener's connection bound
(transfer/tcp/)."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from support import transfer_common
from support.kv_pools import SenderProcess, fill_pool, make_pool
from support.transfer_common import RECEIVER_SEED, SENDER_SEED, SPEC, u8

from splitserve.transfer import TCP, PeerLost, TransferError, TransferTimeout, open_receiver
from splitserve.transfer.reservation import block_nbytes
from splitserve.transfer.tcp.receiver import TcpReceiver
from splitserve.transfer.tcp.wire import (
    ACK,
    ALL_LAYERS,
    OK,
    REFUSED,
    WireError,
    checksum,
    pack_chunk,
    read_ack,
)

SOURCE = fill_pool(make_pool(**SPEC), SENDER_SEED)
NBYTES = block_nbytes(SOURCE)


@pytest.fixture(scope="module")
def cluster():
    """A tcp-only receiver here; a sender process cutting transfers into 3-block chunks over 2
    connections, and one that will be killed."""
    pool = fill_pool(make_pool(**SPEC), RECEIVER_SEED)
    rx = open_receiver(pool, "decode-0", paths=(TCP,), host="127.0.0.1")
    opts = dict(streams=2, chunk_bytes=3 * NBYTES)
    senders = {
        name: SenderProcess(name, SPEC, SENDER_SEED, tcp_options=opts)
        for name in ("prefill-0", "prefill-doomed")
    }
    try:
        for sender in senders.values():
            sender.wait_ready()
            assert sender.call("connect", rx.endpoint().to_bytes()) == TCP
        yield rx, pool, senders
    finally:
        for sender in senders.values():
            sender.stop()
        rx.shutdown()


def ship(rx, sender, src, dst, timeout=10.0):
    return transfer_common.ship(rx, sender, src, dst, TCP, timeout)


def test_tcp_ships_blocks_byte_exact_in_chunks(cluster):
    rx, pool, senders = cluster
    before = pool.clone()
    src = [7, 1, 12, 3, 1, 19, 22, 8]  # 8 blocks: chunks of 3, 3, 2 over two connections
    dst = [20, 2, 9, 15, 5, 11, 23, 4]
    res, nbytes = ship(rx, senders["prefill-0"], src, dst)
    assert res.state == "done" and nbytes == len(src) * NBYTES
    assert torch.equal(u8(pool[dst]), u8(SOURCE[src]))
    rest = [i for i in range(SPEC["num_blocks"]) if i not in dst]
    assert torch.equal(u8(pool[rest]), u8(before[rest]))
    # Again over the kept connections.
    res, _ = ship(rx, senders["prefill-0"], [2, 3], [6, 7])
    assert torch.equal(u8(pool[[6, 7]]), u8(SOURCE[[2, 3]]))


def test_a_reservation_filled_by_layer_ranges_completes_when_every_layer_is_in(cluster):
    rx, pool, senders = cluster
    sender = senders["prefill-0"]
    layers = SPEC["num_layers"]
    assert layers >= 2
    src, dst = [3, 9, 14, 2], [21, 17, 13, 18]
    before = pool.clone()
    res = rx.reserve("prefill-0", dst, TCP)
    ticket = res.ticket.to_bytes()
    # Layer 0 of every block, then the rest of blocks 2..3, then of blocks 0..1.
    assert sender.call("send_part", ticket, 0, src, (0, 1), 10.0) == len(src) * NBYTES // layers
    assert res.state == "reserved"
    with pytest.raises(TransferError, match="before every tcp chunk"):
        rx.finish(res)  # a sender that stops half way: Incomplete
    res = rx.reserve("prefill-0", dst, TCP)
    ticket = res.ticket.to_bytes()
    sender.call("send_part", ticket, 0, src, (0, 1), 10.0)
    sender.call("send_part", ticket, 2, src[2:], (1, layers), 10.0)
    assert res.state == "reserved"
    assert torch.equal(u8(pool[dst[2:]]), u8(SOURCE[src[2:]]))
    sender.call("send_part", ticket, 0, src[:2], (1, layers), 10.0)
    rx.finish(res)
    assert res.state == "done" and torch.equal(u8(pool[dst]), u8(SOURCE[src]))
    rest = [i for i in range(SPEC["num_blocks"]) if i not in dst]
    assert torch.equal(u8(pool[rest]), u8(before[rest]))
    # A layer sent twice fails the reservation; a range outside the pool's is refused.
    res = rx.reserve("prefill-0", dst[:1], TCP)
    ticket = res.ticket.to_bytes()
    sender.call("send_part", ticket, 0, src[:1], (0, 1), 10.0)
    with pytest.raises(RuntimeError, match="sent twice"):
        sender.call("send_part", ticket, 0, src[:1], (0, layers), 10.0)
    assert res.state == "failed"
    with pytest.raises(RuntimeError, match="not a range"):
        sender.call("send_part", ticket, 0, src[:1], (1, layers + 1), 10.0)
    # The sender still ships whole blocks afterwards.
    res, _ = ship(rx, sender, [5, 6], [6, 7])
    assert torch.equal(u8(pool[[6, 7]]), u8(SOURCE[[5, 6]]))


def test_a_forged_layer_range_is_refused(cluster):
    rx, _, _ = cluster
    layers = SPEC["num_layers"]
    res = rx.reserve("someone", [5, 6], TCP)
    block = bytes(u8(SOURCE[3]).reshape(-1).numpy())
    with pytest.raises(WireError, match="outside the pool"):
        raw_chunk(rx, res.ticket.token, 0, 1, block, lo=layers, hi=layers + 1)
    assert res.state == "failed"


def raw_chunk(rx, token, first, count, data: bytes, crc=None, lo=0, hi=ALL_LAYERS):
    """Send one chunk by hand; the receiver's ack (WireError if refused)."""
    crc = checksum(data) if crc is None else crc
    with socket.create_connection(("127.0.0.1", rx.endpoint().tcp.port), timeout=5) as sock:
        sock.sendall(pack_chunk(token, first, count, crc, lo, hi))
        sock.sendall(data)
        read_ack(sock)


def test_forged_and_bad_chunks_are_refused(cluster):
    rx, pool, _ = cluster
    before = pool.clone()
    block = bytes(u8(SOURCE[3]).reshape(-1).numpy())
    with pytest.raises(WireError, match="no open reservation"):
        raw_chunk(rx, b"x" * 16, 0, 1, block)
    res = rx.reserve("someone", [5, 6], TCP)
    with pytest.raises(WireError, match="outside the reservation"):
        raw_chunk(rx, res.ticket.token, 1, 2, block * 2)
    assert res.state == "failed"  # a sender that breaks the protocol loses the reservation
    res = rx.reserve("someone", [5, 6], TCP)
    with pytest.raises(WireError, match="CRC mismatch"):
        raw_chunk(rx, res.ticket.token, 0, 1, block, crc=checksum(block) ^ 1)
    assert res.state == "failed"
    with pytest.raises(TransferError):
        rx.receive(res, 1.0)
    res = rx.reserve("someone", [5, 6], TCP)
    raw_chunk(rx, res.ticket.token, 0, 1, block)
    with pytest.raises(WireError, match="sent twice"):
        raw_chunk(rx, res.ticket.token, 0, 1, block)
    assert res.state == "failed"
    assert torch.equal(u8(pool[[1, 2, 3, 4, 6]]), u8(before[[1, 2, 3, 4, 6]]))
    # The receiver still serves good transfers.
    res = rx.reserve("someone", [5, 6], TCP)
    raw_chunk(rx, res.ticket.token, 0, 2, bytes(u8(SOURCE[[8, 9]]).reshape(-1).numpy()))
    rx.receive(res, 5.0)
    assert res.state == "done" and torch.equal(u8(pool[[5, 6]]), u8(SOURCE[[8, 9]]))


def test_a_cancelled_reservation_takes_no_more_data(cluster):
    rx, pool, _ = cluster
    before = pool.clone()
    res = rx.reserve("someone", [10, 12], TCP)
    rx.cancel(res)
    with pytest.raises(WireError, match="no open reservation"):
        raw_chunk(rx, res.ticket.token, 0, 2, bytes(u8(SOURCE[[1, 2]]).reshape(-1).numpy()))
    assert torch.equal(u8(pool[[10, 12]]), u8(before[[10, 12]]))


def test_sender_killed_mid_chunk_times_out_and_leaves_the_pool(cluster):
    rx, pool, senders = cluster
    before = pool.clone()
    doomed = senders["prefill-doomed"]
    res = rx.reserve(doomed.node_id, [13, 14, 16], TCP)
    doomed.request("send_tcp_half_then_kill", res.ticket.to_bytes(), [1, 2, 3])
    assert doomed.reply() == "half a chunk sent"
    doomed.proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        rx.receive(res, 1.0)
    assert time.monotonic() - t0 < 30  # its 1 s timeout, not a hang (a bound, not a speed)
    assert res.state == "failed"
    assert torch.equal(u8(pool[[13, 14, 16]]), u8(before[[13, 14, 16]]))
    ship(rx, senders["prefill-0"], [4], [13])  # the next transfer still works


def test_sender_sees_a_gone_receiver():
    pool = fill_pool(make_pool(**SPEC), RECEIVER_SEED)
    rx = open_receiver(pool, "decode-gone", paths=(TCP,), host="127.0.0.1")
    sender = SenderProcess("prefill-1", SPEC, SENDER_SEED)
    try:
        sender.wait_ready()
        assert sender.call("connect", rx.endpoint().to_bytes()) == TCP
        ticket = rx.reserve(sender.node_id, [1], TCP).ticket.to_bytes()
        rx.shutdown()
        with pytest.raises(RuntimeError, match=PeerLost.__name__):
            sender.call("send", ticket, [2], 5.0)
    finally:
        sender.stop()


def test_listener_bounds_connections():
    pool = make_pool(4, num_layers=1, head_dim=4)
    rx = TcpReceiver(pool, "decode-bounded", host="127.0.0.1", max_connections=2)
    socks = []
    try:
        for _ in range(2):
            socks.append(socket.create_connection(("127.0.0.1", rx.address.port), timeout=5))
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", rx.address.port), timeout=5)
        assert extra.recv(1) == b""  # closed at once
        extra.close()
        # The two kept connections still serve: a forged chunk on one is answered.
        socks[0].sendall(pack_chunk(b"y" * 16, 0, 1, 0))
        head = socks[0].recv(ACK.size)
        assert ACK.unpack(head)[0] == REFUSED != OK
    finally:
        for sock in socks:
            sock.close()
        rx.shutdown()


def test_finishing_a_prefix_takes_only_blocks_that_arrived(cluster):
    """A peer holding fewer blocks than asked fills the first n of a reservation: it ends done
    with those n in; claiming more than arrived fails it."""
    rx, pool, _ = cluster
    two = bytes(u8(SOURCE[[5, 6]]).reshape(-1).numpy())
    res = rx.reserve("peer", [17, 18, 19, 21], TCP)
    raw_chunk(rx, res.ticket.token, 0, 2, two)
    rx.finish(res, 2)
    assert res.state == "done" and torch.equal(u8(pool[[17, 18]]), u8(SOURCE[[5, 6]]))
    res = rx.reserve("peer", [17, 18, 19, 21], TCP)
    raw_chunk(rx, res.ticket.token, 0, 2, two)
    with pytest.raises(TransferError, match="did not all arrive"):
        rx.finish(res, 3)
    assert res.state == "failed"
