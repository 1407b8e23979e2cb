"""Per-peer caps of a decode node (decode_node/peer_caps.py) on their own: a peer over its
transfer or block cap is refused with RESOURCE_EXHAUSTED naming the option to raise, another peer
is not, a peer's first transfer passes whatever its size, and every share taken comes back once
(releasing twice gives nothing back twice) whatever order transfers end in. The TransferKV calls
through them, against a real decode node, are in tests/cluster/test_peer_caps.py."""

from __future__ import annotations

import contextlib
import random
from collections import Counter

import pytest

from splitserve.decode_node.header import TransferRefused
from splitserve.decode_node.peer_caps import MAX_PEER_ID_CHARS, PeerCaps, PeerLimits
from splitserve.runtime import counter_names as names
from splitserve.runtime.failure import Failure


def caps(max_transfers: int = 2, max_blocks: int = 10) -> PeerCaps:
    return PeerCaps(PeerLimits(max_transfers, max_blocks), Counter())


def test_a_peer_at_its_transfer_cap_is_refused_and_another_peer_is_not():
    c = caps(max_transfers=2)
    held = [c.admit("p0", 1), c.admit("p0", 1)]
    with pytest.raises(TransferRefused) as refused:
        c.admit("p0", 1)
    assert refused.value.code == Failure.REFUSED
    assert "--max-transfers-per-peer" in str(refused.value) and "'p0'" in str(refused.value)
    assert c.counters[names.TRANSFERS_REFUSED_PEER_TRANSFERS] == 1
    other = c.admit("p1", 1)
    assert c.held("p0") == (2, 2) and c.held("p1") == (1, 1)
    held[0].release()
    c.admit("p0", 1).release()  # room again once one ended
    for hold in (*held, other):
        hold.release()
    assert c.num_peers == 0 and c.held("p0") == (0, 0)


def test_a_peer_over_its_block_cap_is_refused_but_its_first_transfer_always_passes():
    c = caps(max_transfers=8, max_blocks=10)
    big = c.admit("p0", 25)  # larger than the cap, but alone: let through
    with pytest.raises(TransferRefused) as refused:
        c.admit("p0", 1)
    assert refused.value.code == Failure.REFUSED
    assert "--max-kv-share-per-peer" in str(refused.value)
    assert c.counters[names.TRANSFERS_REFUSED_PEER_BLOCKS] == 1
    c.admit("p1", 10).release()  # another peer has its own share
    big.release()
    a = c.admit("p0", 6)
    with pytest.raises(TransferRefused):
        c.admit("p0", 5)  # 6 + 5 > 10
    b = c.admit("p0", 4)  # 6 + 4 == 10: at the cap, not over it
    assert c.held("p0") == (2, 10)
    a.release()
    b.release()
    assert c.num_peers == 0


def test_release_is_idempotent_and_shares_return_to_zero_in_any_order():
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    c = caps(max_transfers=4, max_blocks=40)
    holds = []
    for _ in range(200):
        if holds and rng.random() < 0.5:
            hold = rng.choice(holds)
            hold.release()
            hold.release()  # a second release (cancel after failure) gives nothing back
            holds.remove(hold)
        else:
            with contextlib.suppress(TransferRefused):
                holds.append(c.admit(f"p{rng.randrange(3)}", rng.randrange(1, 20)))
        for peer in ("p0", "p1", "p2"):
            mine = [h for h in holds if h.peer == peer]
            assert c.held(peer) == (len(mine), sum(h.num_blocks for h in mine))
            assert len(mine) <= 4
    for hold in holds:
        hold.release()
    assert c.num_peers == 0


def test_bad_limits_and_peer_ids_are_clear_errors():
    with pytest.raises(ValueError, match="peer limits"):
        PeerLimits(0, 10)
    assert PeerLimits.of_node(3, 0.5, 101) == PeerLimits(3, 50)
    assert PeerLimits.of_node(3, 0.001, 10).max_blocks == 1  # never a cap of no block
    with pytest.raises(TransferRefused) as refused:
        caps().admit("x" * (MAX_PEER_ID_CHARS + 1), 1)
    assert refused.value.code == Failure.INVALID
