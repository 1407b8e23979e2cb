"""KV rank to rank (transfer.shards): a sending pool of tensor parallel size p and a receiving
pool of size d in one gloo group; every rank sends or receives only its pieces of the plan
(kvstore.tp_shards.transfer_plan), from and into its own shard of the pool. Each receiver rank
must end up with exactly the heads it holds of the shipped blocks, in the reserved blocks, and
nothing else written; bad input is refused before anything moves; a transfer whose sender never
comes times out and leaves the pool as it was. The ranks are threads here (one gloo rank each, on
a loopback store); tests/cluster/test_transfer_dist.py runs the dist path across processes."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from splitserve.kvstore.tp_shards import kv_heads_of
from splitserve.transfer.dist.group import loopback_store, make_group, store_client
from splitserve.transfer.errors import TransferTimeout
from splitserve.transfer.shards import ShardGroup, receive_shards, send_shards

LAYERS, BLOCK, HEAD_DIM, NUM_BLOCKS = 2, 4, 8, 12


def _whole_pool(num_kv_heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYERS, 2, BLOCK, num_kv_heads, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype)


def _shard(whole: torch.Tensor, num_kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    heads = kv_heads_of(num_kv_heads, tp, rank)
    return whole[..., heads.start : heads.stop, :].clone()


def _run_ranks(size: int, work, timeout_s: float = 30.0) -> list:
    """``work(pg, group_rank)`` on ``size`` threads, each a rank of one gloo group."""
    store, port = loopback_store(timeout_s)
    results: list = [None] * size
    # Every rank's group stays alive until all are done, as a node's does (a rank with nothing
    # to send whose group went early closed its connections under the others' feet).
    all_done = threading.Barrier(size)

    def rank_main(rank: int) -> None:
        pg = None
        try:
            client = store if rank == 0 else store_client("127.0.0.1", port, timeout_s)
            pg = make_group(client, rank, size, "gloo", timeout_s, host="127.0.0.1")
            results[rank] = work(pg, rank)
        except BaseException as exc:  # handed to the test
            results[rank] = exc
        finally:
            with contextlib.suppress(threading.BrokenBarrierError):
                all_done.wait(timeout_s * 2)
            del pg

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.mark.parametrize(
    "num_kv_heads, p, d",
    [(4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 4, 2), (4, 2, 4), (4, 1, 4), (2, 4, 2), (2, 1, 4)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_receiver_rank_gets_exactly_its_heads_of_the_shipped_blocks(num_kv_heads, p, d, dtype):
    group = ShardGroup(num_kv_heads, sender_tp=p, receiver_tp=d)
    whole = _whole_pool(num_kv_heads, dtype, seed=p * 10 + d)
    src, dst = [3, 7, 1, 10], [5, 2, 11, 8]
    senders = [_shard(whole, num_kv_heads, p, s) for s in range(p)]
    receivers = [
        torch.zeros_like(_shard(whole, num_kv_heads, d, r)) for r in range(d)
    ]  # fmt: skip

    def work(pg, rank):
        if rank < d:
            return receive_shards(pg, group, rank, receivers[rank], dst, tag=7)
        return send_shards(pg, group, rank - d, senders[rank - d], src, tag=7)

    results = _run_ranks(group.size, work)
    assert not [r for r in results if isinstance(r, BaseException)], results
    element = whole.element_size()
    block_elems = LAYERS * 2 * BLOCK * HEAD_DIM
    for r in range(d):
        heads = kv_heads_of(num_kv_heads, d, r)
        expect = torch.zeros_like(receivers[r])
        expect[dst] = whole[src][..., heads.start : heads.stop, :]
        assert torch.equal(receivers[r], expect), f"receiver rank {r}"
        assert results[r] == len(src) * len(heads) * block_elems * element
    # Every head a receiver holds came once: the bytes sent are the bytes received.
    assert sum(results[d:]) == sum(results[:d])


def test_bad_input_is_refused_before_anything_moves():
    group = ShardGroup(4, sender_tp=2, receiver_tp=2)
    pool = torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="holds 2 KV heads of 4; its pool has 4"):
        send_shards(None, group, 0, torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK, 4, HEAD_DIM), [1])
    with pytest.raises(ValueError, match="null block"):
        receive_shards(None, group, 0, pool, [0, 1])
    with pytest.raises(ValueError):
        receive_shards(None, group, 0, pool, [1, 1])  # a repeat
    with pytest.raises(ValueError):
        send_shards(None, group, 1, pool, [NUM_BLOCKS])  # out of range
    with pytest.raises(ValueError, match="sender rank 2 of 2"):
        send_shards(None, group, 2, pool, [1])
    with pytest.raises(ValueError, match="receiver rank 3 of 2"):
        receive_shards(None, group, 3, pool, [1])


def test_a_sender_that_never_sends_times_out_and_the_pool_is_untouched():
    group = ShardGroup(4, sender_tp=2, receiver_tp=1)
    whole = _whole_pool(4, torch.float32, seed=1)
    receiver = torch.zeros_like(whole)
    sender0 = _shard(whole, 4, 2, 0)

    def work(pg, rank):
        if rank == 0:
            return receive_shards(pg, group, 0, receiver, [4, 5], timeout_s=2.0)
        if rank == 1:  # sender rank 0 sends its piece; sender rank 1 never does
            return send_shards(pg, group, 0, sender0, [1, 2], timeout_s=10.0)
        return "idle"

    results = _run_ranks(group.size, work)
    assert isinstance(results[0], TransferTimeout), results
    assert not receiver.any()  # half the heads had arrived: none written


def test_the_rank_agent_takes_bad_messages_without_raising(caplog):
    """A rank's loop hands every SHARDS message to its agent: nothing it is given may raise
    there (the rank's steps must go on); a transfer for a group it is not in is refused."""
    from splitserve.transfer.shards import ShardAgent, encode

    agent = ShardAgent(torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK, 2, HEAD_DIM), 1, 2, 4)
    for payload in (b"\xc1garbage", encode("join", gid="g"), encode("fly", gid="g"),
                    encode("recv", gid="nowhere", ids=[1], keep=True, timeout=1)):  # fmt: skip
        agent.handle(payload)
    agent.close()
    assert "could not be taken" in caplog.text and "this rank is not in" in caplog.text
