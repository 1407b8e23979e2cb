"""Reservations on a receiver of the byte path alone (transfer/; no listener, no store): bad ids,
writes land only in reserved ids, cancelled reservations take no writes, paths the receiver does
not offer. What every path's reservations do: test_transfer_contract.py."""

from __future__ import annotations

import pytest
import torch
from support.kv_pools import fill_pool, make_pool
from support.transfer_common import RECEIVER_SEED, SPEC, u8

from splitserve.transfer import (
    DIST,
    GRPC,
    IPC,
    TCP,
    Incomplete,
    NotConnected,
    TransferError,
    open_receiver,
)


@pytest.fixture
def local_receiver():
    pool = fill_pool(make_pool(**SPEC), RECEIVER_SEED)
    rx = open_receiver(pool, "decode-local", paths=())
    yield rx, pool
    rx.shutdown()


@pytest.mark.parametrize(
    "ids",
    [[0], [SPEC["num_blocks"]], [-1], [3, 3], [True], [1.5], ["2"]],
    ids=["null", "past end", "negative", "repeat", "bool", "float", "str"],
)
def test_reserve_rejects_bad_ids(local_receiver, ids):
    rx, _ = local_receiver
    with pytest.raises(ValueError):
        rx.reserve("p", ids, GRPC)


def test_writes_only_reserved_ids(local_receiver):
    rx, pool = local_receiver
    before = pool.clone()
    res = rx.reserve("p", [4, 7, 11], GRPC)
    data = fill_pool(make_pool(**{**SPEC, "num_blocks": 3}), 5)
    for ids in ([4, 8], [5], [0], [SPEC["num_blocks"] + 2], [4, 4]):
        with pytest.raises(ValueError):
            rx.write(res, ids, data[: len(ids)].clone())
    with pytest.raises(ValueError):  # wrong byte count
        rx.write(res, [4], b"\x00" * 10)
    assert torch.equal(u8(pool), u8(before))

    rx.write(res, [11, 4], u8(data[:2]).numpy().tobytes())
    rx.write(res, [7], data[2:3])
    rx.finish(res)
    assert res.state == "done"
    res.result()
    assert torch.equal(u8(pool[[11, 4, 7]]), u8(data))
    rest = [i for i in range(SPEC["num_blocks"]) if i not in (4, 7, 11)]
    assert torch.equal(u8(pool[rest]), u8(before[rest]))
    with pytest.raises(TransferError):  # ended: no more writes
        rx.write(res, [4], data[:1].clone())


def test_cancelled_reservation_takes_no_writes(local_receiver):
    rx, pool = local_receiver
    before = pool.clone()
    res = rx.reserve("p", [2, 3], GRPC)
    rx.cancel(res)
    assert res.state == "cancelled"
    with pytest.raises(TransferError):
        res.result()
    with pytest.raises(TransferError):
        rx.write(res, [2], pool[5:6].clone())
    with pytest.raises(TransferError):
        rx.finish(res)
    assert torch.equal(u8(pool), u8(before))


def test_paths_this_receiver_does_not_offer(local_receiver):
    rx, _ = local_receiver
    assert rx.paths == ()
    assert rx.endpoint().ipc_handle is None and rx.endpoint().dist is None
    for path in (IPC, DIST, TCP):
        with pytest.raises(NotConnected):
            rx.reserve("p", [1], path)
    with pytest.raises(ValueError):
        rx.reserve("p", [1], "carrier-pigeon")
    res = rx.reserve("p", [1], "")  # no path named: the byte path
    assert res.path == GRPC and res.caller_writes and not res.receive_first


def test_finishing_before_every_block_was_written_fails(local_receiver):
    rx, pool = local_receiver
    res = rx.reserve("p", [2, 3, 5], GRPC)
    rx.write(res, [3], pool[9:10].clone())
    rx.receive(res, 1.0)  # the caller writes: nothing to wait for
    with pytest.raises(Incomplete, match="2 blocks missing"):
        rx.finish(res)
    assert res.state == "failed"
    res = rx.reserve("p", [2, 3, 5], GRPC)
    rx.write(res, [2, 3], pool[9:11].clone())
    rx.finish(res, 2)  # a prefix: the first two
    assert res.state == "done"
