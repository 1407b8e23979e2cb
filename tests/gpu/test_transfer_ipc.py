"""The transfer layer's CUDA paths between two processes: ipc (a sender process writing into this
process's pool through a CUDA IPC mapping, both on one GPU) and, with two GPUs, dist over NCCL.
CPU counterpart: tests/unit/test_transfer.py (the same checks over gloo)."""

from __future__ import annotations

import pytest
import torch
from support.kv_pools import SenderProcess, fill_pool, make_pool

from splitserve.transfer import DIST, IPC, TCP, Ticket, TransferError, open_receiver
from splitserve.transfer.reservation import block_nbytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU: the ipc path maps a CUDA KV pool"
    ),
]

SPEC = dict(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=8, head_dim=128)
SENDER_SEED = 4321
RECEIVER_SEED = 77


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.fixture(scope="module")
def ipc_pair():
    spec = {**SPEC, "device": "cuda:0"}
    pool = fill_pool(make_pool(**spec), RECEIVER_SEED)
    torch.cuda.synchronize()
    rx = open_receiver(pool, "decode-gpu", paths=(IPC, TCP))
    sender = SenderProcess("prefill-gpu", spec, SENDER_SEED)
    try:
        sender.wait_ready()
        assert rx.endpoint().ipc_handle
        assert sender.call("connect", rx.endpoint().to_bytes()) == IPC
        source = fill_pool(make_pool(**spec), SENDER_SEED)  # what the sender holds
        torch.cuda.synchronize()
        yield rx, pool, sender, source
    finally:
        sender.stop()
        rx.shutdown()


def test_ipc_ships_blocks_byte_exact(ipc_pair):
    rx, pool, sender, source = ipc_pair
    before = pool.clone()
    src, dst = [5, 60, 1, 33, 7, 7], [40, 2, 63, 17, 9, 10]
    res = rx.reserve(sender.node_id, dst, IPC)
    nbytes, _ = sender.call("send", res.ticket.to_bytes(), src, 30.0)
    rx.finish(res)  # the sender answered only after its copy was synchronized
    assert res.state == "done" and nbytes == len(src) * block_nbytes(pool)
    torch.cuda.synchronize()
    assert torch.equal(u8(pool[dst]), u8(source[src]))
    rest = [i for i in range(SPEC["num_blocks"]) if i not in dst]
    assert torch.equal(u8(pool[rest]), u8(before[rest]))
    # The mapping is cached: a second transfer reuses it.
    assert sender.call("connect", rx.endpoint().to_bytes()) == IPC
    res = rx.reserve(sender.node_id, [3, 4], IPC)
    sender.call("send", res.ticket.to_bytes(), [8, 9], 30.0)
    rx.finish(res)
    torch.cuda.synchronize()
    assert torch.equal(u8(pool[[3, 4]]), u8(source[[8, 9]]))


def test_ipc_prefix_fill_of_a_reservation(ipc_pair):
    """A peer's prefix fetch: the holder had 2 of the 4 reserved blocks and fills those (a ticket
    cut to them); the reservation ends done, the other 2 blocks untouched."""
    rx, pool, sender, source = ipc_pair
    before = pool.clone()
    res = rx.reserve(sender.node_id, [50, 51, 52, 53], IPC)
    cut = Ticket(IPC, res.ticket.receiver_id, sender.node_id, res.block_ids[:2])
    sender.call("send", cut.to_bytes(), [11, 12], 30.0)
    rx.finish(res, 2)
    assert res.state == "done"
    torch.cuda.synchronize()
    assert torch.equal(u8(pool[[50, 51]]), u8(source[[11, 12]]))
    assert torch.equal(u8(pool[[52, 53]]), u8(before[[52, 53]]))


def test_ipc_sender_refuses_bad_destination_ids(ipc_pair):
    rx, pool, sender, _ = ipc_pair
    before = pool.clone()
    res = rx.reserve(sender.node_id, [20, 21], IPC)
    for ids in ((20, SPEC["num_blocks"]), (0, 21), (20, 20)):
        forged = Ticket(IPC, res.ticket.receiver_id, sender.node_id, ids)
        sender.request("send", forged.to_bytes(), [1, 2], 30.0)
        status, message = sender.reply_raw()
        assert status == "error" and message.startswith("ValueError"), message
    torch.cuda.synchronize()
    assert torch.equal(u8(pool), u8(before))
    assert rx.cancel(res) > 0  # cancelled before the sender finished: free only after a grace
    with pytest.raises(TransferError):
        rx.finish(res)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="dist over NCCL needs two GPUs")
def test_nccl_ships_blocks_byte_exact():
    pool = fill_pool(make_pool(**{**SPEC, "device": "cuda:0"}), RECEIVER_SEED)
    torch.cuda.synchronize()
    rx = open_receiver(pool, "decode-nccl", paths=(DIST, TCP), host="127.0.0.1")
    sender = SenderProcess("prefill-nccl", {**SPEC, "device": "cuda:1"}, SENDER_SEED)
    try:
        sender.wait_ready()
        endpoint = rx.endpoint()
        assert endpoint.dist is not None and endpoint.dist.backend == "nccl"
        assert sender.call("connect", endpoint.to_bytes()) == DIST
        source = fill_pool(make_pool(**{**SPEC, "device": "cuda:1"}), SENDER_SEED)
        before = pool.clone()
        src, dst = [5, 60, 1, 33], [40, 2, 63, 17]
        res = rx.reserve(sender.node_id, dst, DIST)
        sender.request("send", res.ticket.to_bytes(), src, 60.0)
        rx.receive(res, 60.0)
        sender.reply()
        assert torch.equal(u8(pool[dst]), u8(source[src].to("cuda:0")))
        rest = [i for i in range(SPEC["num_blocks"]) if i not in dst]
        assert torch.equal(u8(pool[rest]), u8(before[rest]))
    finally:
        sender.stop()
        rx.shutdown()
