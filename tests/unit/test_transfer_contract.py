"""The transfer interface's contract (tests/support/transfer_contract.py) on the paths that run
with no socket: the byte path (``grpc``: the caller's stream carries the blocks), as a node's
receiver/sender and as the path's own sides; and a path added behind the interface
(``MemoryPath``, within this process): one module's worth of code and its line in the chooser's
preference, with nothing else changed — the node's sender chooses it, the node's receiver serves
it, its offer travels in the endpoint's bytes. tcp and dist: tests/cluster/
test_transfer_contract_paths.py; ipc (CUDA, two processes): tests/gpu/test_transfer_ipc.py."""

from __future__ import annotations

import pytest
from support.kv_pools import fill_pool, make_pool
from support.transfer_common import RECEIVER_SEED, SENDER_SEED, SPEC
from support.transfer_contract import *  # noqa: F403 (the contract's tests)
from support.transfer_contract import (
    MEMORY,
    MEMORY_PATH,
    RECEIVER_ID,
    SENDER_ID,
    MemoryReceiver,
    MemorySender,
    Rig,
)

from splitserve.transfer import (
    GRPC,
    Endpoint,
    NodeReceiver,
    NodeSender,
    choose_path,
    chooser,
    open_receiver,
    open_sender,
)
from splitserve.transfer.grpc_bytes import GrpcReceiver, GrpcSender

BUILT_IN = chooser.PREFERENCE  # the chooser's own lines (the rigs add the test path's)


def _pools():
    return fill_pool(make_pool(**SPEC), RECEIVER_SEED), fill_pool(make_pool(**SPEC), SENDER_SEED)


def _byte_path(pool, source, node: bool) -> Rig:
    if node:
        rx, tx = (
            open_receiver(pool, RECEIVER_ID, paths=()),
            open_sender(source, SENDER_ID, paths=()),
        )
    else:
        rx, tx = GrpcReceiver(pool, RECEIVER_ID), GrpcSender(source, SENDER_ID)
    return Rig(GRPC, rx, tx, pool, source, waits=False)


def _with_memory(pool, source) -> tuple[NodeReceiver, NodeSender]:
    """A node's receiver and sender with the new path among their parts."""
    rx_parts = {GRPC: GrpcReceiver(pool, RECEIVER_ID), MEMORY: MemoryReceiver(pool, RECEIVER_ID)}
    tx_parts = {GRPC: GrpcSender(source, SENDER_ID), MEMORY: MemorySender(source, SENDER_ID)}
    return NodeReceiver(pool, RECEIVER_ID, rx_parts), NodeSender(source, SENDER_ID, tx_parts)


def _memory_path(pool, source, node: bool) -> Rig:
    if node:
        rx, tx = _with_memory(pool, source)
    else:
        rx, tx = MemoryReceiver(pool, RECEIVER_ID), MemorySender(source, SENDER_ID)
    return Rig(MEMORY, rx, tx, pool, source)


RIGS = {
    "grpc-node": lambda p, s: _byte_path(p, s, True),
    "grpc-sides": lambda p, s: _byte_path(p, s, False),
    "memory-node": lambda p, s: _memory_path(p, s, True),
    "memory-sides": lambda p, s: _memory_path(p, s, False),
}


@pytest.fixture(scope="module", params=list(RIGS))
def rig(request):
    with pytest.MonkeyPatch.context() as patch:
        # The new path's line in the chooser: preferred to every other.
        patch.setattr(chooser, "PREFERENCE", (MEMORY_PATH, *BUILT_IN))
        rig = RIGS[request.param](*_pools())
        rig.connect()
        yield rig
        rig.close()


def test_a_path_added_behind_the_interface_is_chosen_and_served():
    pool, source = _pools()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chooser, "PREFERENCE", (MEMORY_PATH, *BUILT_IN))
        rx, tx = _with_memory(pool, source)
        handshake = rx.endpoint().to_bytes()
        assert Endpoint.from_bytes(handshake).offers == ((MEMORY, rx.offer()[MEMORY]),)
        assert tx.connect(handshake) == MEMORY
        res = rx.reserve(SENDER_ID, [3, 5], MEMORY)
        assert tx.send(res.ticket.to_bytes(), [7, 9], timeout=1.0) > 0
        rx.receive(res, 1.0)
        rx.finish(res)
        assert res.state == "done"
        # Without its line in the chooser the pair takes the byte path.
        patch.setattr(chooser, "PREFERENCE", BUILT_IN)
        assert choose_path(tx.endpoint(), rx.endpoint(), [GRPC, MEMORY]) == GRPC
        tx.close(RECEIVER_ID)
        assert tx.connect(handshake) == GRPC
        rx.shutdown()


def test_endpoints_without_added_paths_keep_their_bytes():
    """The ``offers`` field is in the wire format only when a path put something in it."""
    pool, _ = _pools()
    rx = open_receiver(pool, RECEIVER_ID, paths=())
    assert b"offers" not in rx.endpoint().to_bytes()
