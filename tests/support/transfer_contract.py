"""The transfer layer's interface contract (``transfer.base``), as tests that run against any path.

A test module imports the ``test_*`` functions below and defines a module-scoped ``rig`` fixture
(a ``Rig``: one path's receiver and sender, each a ``NodeReceiver``/``NodeSender`` or the path's
own sides, in this process): tests/unit/test_transfer_contract.py runs them on the byte path and
on ``MemoryPath`` (a path added behind the interface the way docs/transfer.md describes, with no
socket), tests/cluster/test_transfer_contract_paths.py on tcp and dist over loopback. The tests
act only on what the interface says (a reservation's ``caller_writes`` / ``receive_first``,
``finish`` and ``cancel``'s answers), never on a path's name.

Random ids are drawn from a seed printed on failure (``SPLITSERVE_TEST_SEED`` repeats one).
"""

from __future__ import annotations

import dataclasses
import os
import random
import secrets
import threading
from collections.abc import Collection
from dataclasses import dataclass

import pytest
import torch

from splitserve.transfer import (
    Endpoint,
    Incomplete,
    KVReceiver,
    KVSender,
    NotConnected,
    PathOptions,
    Reservation,
    Ticket,
    TransferError,
    TransferPath,
    TransferTimeout,
    choose_path,
)
from splitserve.transfer.base import BlockIds, as_endpoint, check_count, check_path, own_ticket
from splitserve.transfer.reservation import RESERVED, block_nbytes, check_source_ids
from support.transfer_common import u8

TIMEOUT_S = 10.0
SENDER_ID, RECEIVER_ID = "prefill-c", "decode-c"


@dataclass
class Rig:
    """One path between two pools of this process. ``prefix``: its senders can fill the first
    n blocks of a reservation; ``waits``: its receiver can tell when the blocks are in (so
    ``receive`` waits for them, and times out)."""

    name: str
    rx: KVReceiver
    tx: KVSender
    pool: torch.Tensor  # the receiver's
    source: torch.Tensor  # the sender's
    prefix: bool = True
    waits: bool = True

    def connect(self) -> None:
        assert self.tx.connect(self.rx.endpoint().to_bytes()) == self.name

    def close(self) -> None:
        self.tx.close_all()
        self.rx.shutdown()


def seeded() -> random.Random:
    seed = int(os.environ.get("SPLITSERVE_TEST_SEED", secrets.randbits(32)))
    print(f"transfer contract: seed {seed} (SPLITSERVE_TEST_SEED={seed} repeats it)")
    return random.Random(seed)


def pick(rng: random.Random, rig: Rig, n: int, taken: Collection[int] = ()) -> list[int]:
    """``n`` distinct destination ids (never the null block, nor ``taken``)."""
    free = [b for b in range(1, rig.pool.shape[0]) if b not in taken]
    return rng.sample(free, n)


def move(rig: Rig, items: list[tuple[Reservation, list[int]]], receive=()) -> list[object]:
    """Move each ``(reservation, source ids)`` as the path does — the caller writes what its
    stream carries, or the sender sends (the first ``len(src)`` reserved blocks: a cut ticket)
    — while this side ``receive``s the reservations in ``receive``; what each move returned
    (bytes moved, or the ``TransferError``/``ValueError`` it raised)."""
    results: list[object] = []

    def one(res: Reservation, src: list[int]) -> object:
        try:
            if res.caller_writes:
                rig.rx.write(res, res.block_ids[: len(src)], rig.source[src].clone())
                return len(src) * block_nbytes(rig.pool)
            ticket = dataclasses.replace(res.ticket, block_ids=res.block_ids[: len(src)])
            return rig.tx.send(ticket, src, timeout=TIMEOUT_S)
        except (TransferError, ValueError) as exc:
            return exc

    sender = threading.Thread(target=lambda: results.extend(one(r, s) for r, s in items))
    sender.start()  # the receiver may have to take part while the sender sends
    for res in receive:
        rig.rx.receive(res, TIMEOUT_S)
    sender.join(3 * TIMEOUT_S)
    assert not sender.is_alive()
    return results


# ------------------------------------------------------------------------------ the contract


def test_both_sides_name_the_path_and_the_endpoint_carries_its_offer(rig: Rig):
    layer = rig.name in rig.tx.paths
    assert rig.rx.paths == rig.tx.paths == ((rig.name,) if layer else ())
    peer = Endpoint.from_bytes(rig.rx.endpoint().to_bytes())
    assert (peer.offered(rig.name) is not None) == layer
    assert peer.node_id == rig.rx.node_id and peer.block_shape == tuple(rig.pool.shape[1:])
    assert choose_path(rig.tx.endpoint(), peer, rig.rx.paths) == rig.name
    rig.connect()  # again: cached
    assert rig.tx.path(rig.rx.node_id) == rig.name


def test_a_transfer_lands_byte_exact_and_touches_nothing_else(rig: Rig):
    rng = seeded()
    before = rig.pool.clone()
    n = rng.randint(1, 9)
    src, dst = rng.choices(range(rig.source.shape[0]), k=n), pick(rng, rig, n)
    res = rig.rx.reserve(SENDER_ID, dst, rig.name)
    assert res.state == RESERVED and res.block_ids == tuple(dst)
    assert res.ticket.sender_id == SENDER_ID and res.ticket.receiver_id == rig.rx.node_id
    (moved,) = move(rig, [(res, src)], receive=[res])
    assert moved == n * block_nbytes(rig.pool) == res.nbytes
    rig.rx.finish(res)
    assert res.state == "done" and res.ended and res.error is None
    res.result()
    assert torch.equal(u8(rig.pool[dst]), u8(rig.source[src]))
    rest = [b for b in range(rig.pool.shape[0]) if b not in dst]
    assert torch.equal(u8(rig.pool[rest]), u8(before[rest]))
    assert rig.rx.cancel(res) == 0.0  # finished: nothing can still land, free at once
    assert res.state == "done"


def test_a_reservation_of_no_blocks_is_done_at_once(rig: Rig):
    res = rig.rx.reserve(SENDER_ID, [], rig.name)
    assert res.state == "done"
    rig.rx.receive(res, TIMEOUT_S)
    rig.rx.finish(res)


@pytest.mark.parametrize("ids", [[0], [10**6], [-1], [3, 3], [True], [1.5]])
def test_bad_destination_ids_are_refused_before_anything_is_reserved(rig: Rig, ids):
    with pytest.raises(ValueError):
        rig.rx.reserve(SENDER_ID, ids, rig.name)


def test_a_cancelled_reservation_takes_no_data_and_the_next_one_does(rig: Rig):
    rng = seeded()
    before = rig.pool.clone()
    dropped_ids = pick(rng, rig, 3)
    dropped = rig.rx.reserve(SENDER_ID, dropped_ids, rig.name)
    kept = rig.rx.reserve(SENDER_ID, pick(rng, rig, 2, set(dropped_ids)), rig.name)
    # A path whose sender writes into this pool itself (ipc, nixl) cannot stop a write it has
    # queued: its cancel answers a grace to wait before the blocks are freed, and it is its
    # sender that stops (the services tell it); the others stop every write at once.
    sender_writes = not rig.waits and not dropped.caller_writes
    grace = rig.rx.cancel(dropped)
    assert grace > 0.0 if sender_writes else grace == 0.0
    assert dropped.state == "cancelled"
    assert rig.rx.cancel(dropped) == (grace if sender_writes else 0.0)  # idempotent
    with pytest.raises(TransferError):
        dropped.result()
    moves = [(kept, [4, 5])] if sender_writes else [(dropped, [1, 2, 3]), (kept, [4, 5])]
    move(rig, moves, receive=[kept])
    rig.rx.finish(kept)
    assert torch.equal(u8(rig.pool[dropped_ids]), u8(before[dropped_ids]))
    assert torch.equal(u8(rig.pool[list(kept.block_ids)]), u8(rig.source[[4, 5]]))
    with pytest.raises(TransferError):
        rig.rx.finish(dropped)


def test_finishing_before_the_blocks_arrived_fails_the_reservation(rig: Rig):
    res = rig.rx.reserve(SENDER_ID, pick(seeded(), rig, 3), rig.name)
    if not rig.waits and not res.caller_writes:
        pytest.skip("only the sender can tell (it writes into this pool itself)")
    with pytest.raises(Incomplete):
        rig.rx.finish(res)
    assert res.state == "failed" and isinstance(res.error, Incomplete)
    rig.rx.cancel(res)


def test_finishing_a_prefix_takes_the_blocks_that_came(rig: Rig):
    rng = seeded()
    before = rig.pool.clone()
    dst = pick(rng, rig, 4)
    res = rig.rx.reserve(SENDER_ID, dst, rig.name)
    if not rig.prefix:
        with pytest.raises(ValueError):
            rig.rx.finish(res, 2)
        rig.rx.cancel(res)
        return
    move(rig, [(res, [6, 7])])  # the holder had only two of the four
    rig.rx.finish(res, 2)
    assert res.state == "done"
    assert torch.equal(u8(rig.pool[dst[:2]]), u8(rig.source[[6, 7]]))
    assert torch.equal(u8(rig.pool[dst[2:]]), u8(before[dst[2:]]))
    if rig.waits or res.caller_writes:  # claiming more than came fails
        res = rig.rx.reserve(SENDER_ID, dst, rig.name)
        move(rig, [(res, [6, 7])])
        with pytest.raises(Incomplete):
            rig.rx.finish(res, 3)
        assert res.state == "failed"
    res = rig.rx.reserve(SENDER_ID, dst, rig.name)
    with pytest.raises(ValueError):
        rig.rx.finish(res, 5)  # more than reserved
    rig.rx.cancel(res)


def test_the_sender_checks_its_ticket_and_moves_nothing_on_a_bad_one(rig: Rig):
    before = rig.pool.clone()
    res = rig.rx.reserve(SENDER_ID, pick(seeded(), rig, 2), rig.name)
    foreign = dataclasses.replace(res.ticket, sender_id="someone-else")
    for ticket, src in ((res.ticket, [1]), (foreign, [1, 2]), (res.ticket, [10**6, 1])):
        with pytest.raises(ValueError):
            rig.tx.send(ticket, src, timeout=TIMEOUT_S)
    assert torch.equal(u8(rig.pool), u8(before))
    rig.rx.cancel(res)


def test_close_forgets_the_peer_and_connect_sets_the_path_up_again(rig: Rig):
    rig.tx.close(rig.rx.node_id)
    if rig.name in rig.tx.paths:
        assert rig.tx.path(rig.rx.node_id) is None
        res = rig.rx.reserve(SENDER_ID, [1], rig.name)
        with pytest.raises(NotConnected):
            rig.tx.send(res.ticket, [1], timeout=TIMEOUT_S)
        rig.rx.cancel(res)
    rig.connect()
    assert rig.tx.path(rig.rx.node_id) == rig.name


def test_receive_waits_where_the_receiver_can_tell_and_times_out(rig: Rig):
    """Last: a dist pair that timed out is torn down (and set up again here)."""
    res = rig.rx.reserve(SENDER_ID, [1, 2], rig.name)
    if not rig.waits:
        rig.rx.receive(res, 0.2)  # the caller (or the sender) tells: nothing to wait for
        assert res.state == RESERVED
        rig.rx.cancel(res)
        return
    with pytest.raises(TransferTimeout):
        rig.rx.receive(res, 0.3)
    assert res.state == "failed" and isinstance(res.error, TransferTimeout)
    rig.tx.close(rig.rx.node_id)
    rig.connect()


# ------------------------------------------------------------------------------ a test path

MEMORY = "memory"
_MEMORY_RECEIVERS: dict[bytes, MemoryReceiver] = {}  # this process's, by the token they offer


class MemoryReceiver(KVReceiver):
    """A path within one process, added the way docs/transfer.md outlines: its receiver offers a
    token (bytes, carried in the endpoint's ``offers``), its sender finds the receiver by it and
    lands blocks through the reservation, by position, as the tcp listener does."""

    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        self.kv_pool, self.node_id = kv_pool, node_id
        self._token = secrets.token_bytes(8)
        self._inbound: dict[bytes, tuple[Reservation, set[int]]] = {}
        self._mu = threading.Lock()
        _MEMORY_RECEIVERS[self._token] = self

    @property
    def paths(self) -> tuple[str, ...]:
        return (MEMORY,)

    def offer(self) -> dict[str, object]:
        return {MEMORY: self._token}

    def reserve(self, peer_id: str, block_ids: BlockIds, path: str = MEMORY) -> Reservation:
        check_path(path, MEMORY)
        token = secrets.token_bytes(16)
        res = Reservation(self.kv_pool, self.node_id, peer_id, MEMORY, block_ids, token=token)
        if not res.block_ids:
            res.end_done()
        with self._mu:
            self._inbound[token] = (res, set())
        return res

    def land(self, token: bytes, blocks: torch.Tensor) -> None:
        """The sender's side: the reservation's first ``len(blocks)`` blocks."""
        with self._mu:
            res, landed = self._inbound.get(token, (None, set()))
        if res is None:
            raise TransferError("no open reservation with this token")
        res.write(res.block_ids[: len(blocks)], blocks)
        landed.update(range(len(blocks)))
        if len(landed) == len(res.block_ids):
            res.end_done()

    def receive(self, res: Reservation, timeout: float) -> None:
        if not res.wait(timeout):
            res.end_failed(TransferTimeout(f"nothing landed within {timeout} s"))
        res.result()

    def finish(self, res: Reservation, count: int | None = None) -> None:
        n = check_count(res, count)
        with self._mu:
            _, landed = self._inbound.pop(res.ticket.token, (None, set()))
        if res.state == RESERVED and not set(range(n)) <= landed:
            res.end_failed(Incomplete(f"the first {n} blocks did not all land"))
        res.end_done()

    def cancel(self, res: Reservation) -> float:
        res.end_cancelled()
        with self._mu:
            self._inbound.pop(res.ticket.token, None)
        return 0.0

    def shutdown(self) -> None:
        _MEMORY_RECEIVERS.pop(self._token, None)


class MemorySender(KVSender):
    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        self.kv_pool, self.node_id = kv_pool, node_id
        self._peers: dict[str, MemoryReceiver] = {}

    @property
    def paths(self) -> tuple[str, ...]:
        return (MEMORY,)

    def connect(self, peer: Endpoint | bytes) -> str:
        peer = as_endpoint(peer)
        token = peer.offered(MEMORY)
        receiver = _MEMORY_RECEIVERS.get(token) if isinstance(token, bytes) else None
        if receiver is None:
            raise NotConnected(f"{peer.node_id!r} is not a memory receiver of this process")
        self._peers[peer.node_id] = receiver
        return MEMORY

    def path(self, peer_id: str) -> str | None:
        return MEMORY if peer_id in self._peers else None

    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        ticket = own_ticket(ticket, self.node_id, MEMORY)
        receiver = self._peers.get(ticket.receiver_id)
        if receiver is None:
            raise NotConnected(f"not connected to {ticket.receiver_id!r}")
        src = check_source_ids(src_block_ids, self.kv_pool.shape[0])
        if len(src) != len(ticket.block_ids):
            raise ValueError(f"{len(src)} source blocks for {len(ticket.block_ids)} reserved")
        receiver.land(ticket.token, self.kv_pool[src])
        return len(src) * block_nbytes(self.kv_pool)

    def close(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)

    def close_all(self) -> None:
        self._peers.clear()


def _memory_receiver(kv_pool: torch.Tensor, node_id: str, options: PathOptions):
    return MemoryReceiver(kv_pool, node_id)


def _memory_sender(kv_pool: torch.Tensor, node_id: str, options: PathOptions):
    return MemorySender(kv_pool, node_id)


MEMORY_PATH = TransferPath(
    MEMORY,
    reaches=lambda sender, receiver: sender.pid == receiver.pid and bool(receiver.offered(MEMORY)),
    open_receiver=_memory_receiver,
    open_sender=_memory_sender,
)
