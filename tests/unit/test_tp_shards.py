"""kvstore.tp_shards: the KV heads each tensor-parallel rank holds, and the plan that moves a
block's heads between pools of different TP — every receiver head written exactly once, from a
sender that holds it, within both shards."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.kvstore.tp_shards import (
    Piece,
    check_tp,
    holders,
    kv_heads_of,
    replicas,
    transfer_plan,
)

SIZES = (1, 2, 4, 8, 16)


def test_shards_are_contiguous_and_replicated_past_the_kv_heads():
    assert [kv_heads_of(8, 4, r) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]
    assert [kv_heads_of(2, 8, r) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    assert replicas(2, 8) == 4 and replicas(8, 4) == 1
    assert holders(2, 8, 1) == range(4, 8) and holders(8, 4, 5) == range(2, 3)


def test_a_size_that_cannot_shard_says_what_to_change():
    with pytest.raises(ValueError, match="neither divides"):
        check_tp(8, 3)
    with pytest.raises(ValueError, match="attention heads"):
        check_tp(8, 4, num_heads=6)
    with pytest.raises(ValueError, match=">= 1"):
        check_tp(8, 0)
    with pytest.raises(ValueError, match="rank"):
        kv_heads_of(8, 2, 2)


def test_four_senders_into_two_receivers_and_one_into_two():
    assert transfer_plan(8, 4, 2) == [
        Piece(0, 0, 0, 2, 0, 0),
        Piece(1, 0, 2, 2, 0, 2),
        Piece(2, 1, 4, 2, 0, 0),
        Piece(3, 1, 6, 2, 0, 2),
    ]
    assert transfer_plan(8, 1, 2) == [Piece(0, 0, 0, 4, 0, 0), Piece(0, 1, 4, 4, 4, 0)]
    assert transfer_plan(4, 2, 2) == [Piece(0, 0, 0, 2, 0, 0), Piece(1, 1, 2, 2, 0, 0)]


@given(
    st.sampled_from((1, 2, 4, 8)),
    st.sampled_from(SIZES),
    st.sampled_from(SIZES),
)
def test_every_receiver_head_is_written_once_from_a_holder(num_kv_heads, p, d):
    plan = transfer_plan(num_kv_heads, p, d)
    written: dict[tuple[int, int], int] = {}
    for piece in plan:
        sender_shard = kv_heads_of(num_kv_heads, p, piece.sender)
        receiver_shard = kv_heads_of(num_kv_heads, d, piece.receiver)
        assert piece.count >= 1
        for k in range(piece.count):
            head = piece.head + k
            assert sender_shard[piece.src_offset + k] == head
            assert receiver_shard[piece.dst_offset + k] == head
            key = (piece.receiver, head)
            written[key] = written.get(key, 0) + 1
    wanted = {(r, h) for r in range(d) for h in kv_heads_of(num_kv_heads, d, r)}
    assert set(written) == wanted and set(written.values()) == {1}
    # Replicated heads are spread: no sender carries more than its share plus one receiver's.
    load = [sum(p_.count for p_ in plan if p_.sender == s) for s in range(p)]
    per_receiver = len(kv_heads_of(num_kv_heads, d, 0))
    assert max(load) - min(load) <= max(per_receiver * max(d // p, 1), per_receiver)
