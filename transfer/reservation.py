"""Receiver-side reservations: the only blocks of a pool a transfer may write.

The decode node reserves destination block ids (allocated by its KV cache manager, not yet
registered) before the sender sends anything. Every write that a transfer makes goes through its
reservation: ids outside it, out of range, the null block 0 or repeated ids are refused with
``ValueError`` before anything is written. A reservation ends exactly once: ``done`` (every block
written, and on CUDA the copy finished), ``failed`` or ``cancelled``; nothing writes into it after
it ended, so the caller may free (and reuse) its blocks as soon as it ended unsuccessfully.

The sender learns what it needs through a ``Ticket`` (bytes in the services' messages).

A reservation's ``state`` is its transfer's one status; the ``end_*`` and ``fill`` calls are the
paths' side of it (a path's receiver ends its own reservations through them). Callers end a
reservation only through its receiver (``KVReceiver.finish`` / ``cancel``, ``transfer.base``),
which also drops what the path keeps for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import msgpack
import torch

from splitserve.kernels.layout import indexable
from splitserve.transfer.errors import TransferError

NULL_BLOCK_ID = 0  # kernels.layout.NULL_BLOCK_ID: never written

RESERVED = "reserved"
DONE = "done"
FAILED = "failed"
CANCELLED = "cancelled"


def as_id_list(block_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.is_complex():
            raise ValueError("block ids must be a 1-D integer tensor")
        return [int(b) for b in block_ids.tolist()]
    out = []
    for b in block_ids:
        if isinstance(b, bool):
            raise ValueError(f"block ids must be ints, got {b!r}")
        if not isinstance(b, int):
            try:
                b = int(b.__index__())  # numpy integers
            except (AttributeError, TypeError):
                raise ValueError(f"block ids must be ints, got {b!r}") from None
        out.append(int(b))
    return out


def check_block_ids(block_ids: Sequence[int] | torch.Tensor, num_blocks: int) -> list[int]:
    """Destination ids of a pool of ``num_blocks`` blocks: ints in ``[1, num_blocks)`` (block 0
    is the null block), all distinct. ``ValueError`` otherwise."""
    ids = as_id_list(block_ids)
    bad = [b for b in ids if not 0 < b < num_blocks]
    if bad:
        raise ValueError(
            f"block ids must be in [1, {num_blocks}) (0 is the null block), got {bad[:8]}"
        )
    if len(set(ids)) != len(ids):
        raise ValueError("block ids must be distinct")
    return ids


def check_source_ids(block_ids: Sequence[int] | torch.Tensor, num_blocks: int) -> list[int]:
    """Source ids: ints in ``[0, num_blocks)`` (repeats allowed)."""
    ids = as_id_list(block_ids)
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"source block ids must be in [0, {num_blocks}), got {bad[:8]}")
    return ids


def block_nbytes(kv_pool: torch.Tensor) -> int:
    return kv_pool[0].numel() * kv_pool.element_size()


def scatter(
    kv_pool: torch.Tensor,
    block_ids: list[int],
    buffer: torch.Tensor,
    layers: tuple[int, int] | None = None,
) -> None:
    """``kv_pool[block_ids[i]] = buffer[i]`` in one ``index_copy_``; returns once the copy is done
    (CUDA: synchronizes the stream it ran on). Ids must have been checked. ``layers``: only
    layers ``[lo, hi)`` of each block (``buffer`` then holds those layers only)."""
    if layers is not None:
        lo, hi = check_layers(kv_pool, layers)
        kv_pool = kv_pool.narrow(1, lo, hi - lo)
    shape = (len(block_ids), *kv_pool.shape[1:])
    if tuple(buffer.shape) != shape or buffer.dtype != kv_pool.dtype:
        raise ValueError(
            f"buffer must be a {kv_pool.dtype} tensor of shape {shape}, "
            f"got {buffer.dtype} {tuple(buffer.shape)}"
        )
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_pool.device)
    indexable(kv_pool).index_copy_(0, index, indexable(buffer.to(kv_pool.device)))
    if kv_pool.device.type == "cuda":
        torch.cuda.current_stream(kv_pool.device).synchronize()


def check_layers(kv_pool: torch.Tensor, layers: tuple[int, int]) -> tuple[int, int]:
    """``layers`` as ``(lo, hi)``, a non-empty range of the pool's layers (``ValueError``)."""
    lo, hi = layers
    if not 0 <= lo < hi <= kv_pool.shape[1]:
        raise ValueError(f"layers {lo}..{hi} are not a range of the pool's {kv_pool.shape[1]}")
    return lo, hi


def buffer_from_bytes(kv_pool: torch.Tensor, num_blocks: int, data: bytes) -> torch.Tensor:
    """A CPU view of ``num_blocks`` blocks' raw bytes (``kernels.layout.read_blocks_bytes``)."""
    expected = num_blocks * block_nbytes(kv_pool)
    if len(data) != expected:
        raise ValueError(f"got {len(data)} bytes, expected {num_blocks} blocks = {expected}")
    if not num_blocks:
        return torch.empty((0, *kv_pool.shape[1:]), dtype=kv_pool.dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(kv_pool.dtype).view(num_blocks, *kv_pool.shape[1:])


def _packb(obj: object) -> bytes:
    packed = msgpack.packb(obj, use_bin_type=True)
    assert packed is not None  # None only with a stream packer
    return packed


@dataclass(frozen=True, slots=True)
class Ticket:
    """What the sender needs to fill a reservation: the receiver, the pair channel's generation
    and the transfer's sequence number (dist), and the destination block ids, in the order the
    sender's source blocks must be given."""

    path: str
    receiver_id: str
    sender_id: str
    block_ids: tuple[int, ...]
    gen: int = 0
    seq: int = 0
    token: bytes = b""  # tcp: the random name of the reservation its chunks must carry

    def to_bytes(self) -> bytes:
        return _packb(
            [1, self.path, self.receiver_id, self.sender_id, list(self.block_ids), self.gen,
             self.seq, self.token],
        )  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> Ticket:
        try:
            version, path, receiver_id, sender_id, block_ids, gen, seq, *rest = msgpack.unpackb(
                data
            )
            if version != 1 or len(rest) > 1:
                raise ValueError(f"unsupported ticket version {version!r}")
            token = bytes(rest[0]) if rest else b""
            return cls(
                str(path), str(receiver_id), str(sender_id), tuple(as_id_list(block_ids)),
                int(gen), int(seq), token,
            )  # fmt: skip
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"malformed ticket: {exc!r}") from None


class Reservation:
    """Destination blocks of one transfer on the receiver. Made by a receiver's ``reserve``; a
    path that keeps more per transfer subclasses it (``dist.channel.DistReservation``,
    ``grpc_bytes.BytesReservation``).

    Two facts of its path that callers act on (``transfer.base`` says how):
    ``caller_writes`` (the blocks come in the caller's own stream: the sender gets no ticket) and
    ``receive_first`` (the receiver takes the data in itself, in ``receive``)."""

    caller_writes: ClassVar[bool] = False
    receive_first: ClassVar[bool] = False

    def __init__(
        self,
        kv_pool: torch.Tensor,
        receiver_id: str,
        peer_id: str,
        path: str,
        block_ids: Sequence[int] | torch.Tensor,
        *,
        gen: int = 0,
        seq: int = 0,
        token: bytes = b"",
    ) -> None:
        self._pool = kv_pool
        self.block_ids: tuple[int, ...] = tuple(check_block_ids(block_ids, kv_pool.shape[0]))
        self.peer_id = peer_id
        self.path = path
        self.ticket = Ticket(path, receiver_id, peer_id, self.block_ids, gen, seq, token)
        self._mu = threading.Lock()
        self._ended = threading.Event()
        self._state = RESERVED
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return (
            f"Reservation({self.path}, peer={self.peer_id!r}, seq={self.ticket.seq}, "
            f"{len(self.block_ids)} blocks, {self._state})"
        )

    # ---------------------------------------------------------------- status

    @property
    def state(self) -> str:
        """``reserved``, then exactly once ``done``, ``failed`` or ``cancelled``."""
        return self._state

    @property
    def ended(self) -> bool:
        return self._state != RESERVED

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * block_nbytes(self._pool)

    def result(self) -> None:
        """Return if done; raise the failure (or ``TransferError`` if cancelled) otherwise."""
        if self._state == DONE:
            return
        if self._state == RESERVED:
            raise TransferError(f"{self!r} has not completed")
        raise self._error or TransferError(f"{self!r} ended without data")

    def wait(self, timeout: float) -> bool:
        """Block until the reservation ended (True) or ``timeout`` seconds passed (False)."""
        return self._ended.wait(timeout)

    # ---------------------------------------------------------------- the paths' side

    def write(
        self,
        block_ids: Sequence[int] | torch.Tensor,
        data: bytes | torch.Tensor,
        writer: Callable[[list[int], bytes], None] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[int]:
        """Write blocks into reserved ids (a subset, in any order); ``ValueError`` and no write
        if any id is not reserved; returns the ids written. ``data`` is raw block bytes (the gRPC
        codec's payload) or a ``(n, *block_shape)`` tensor on any device. ``writer(ids, data)``:
        writes raw bytes in place of the copy into the pool tensor (a tensor-parallel engine's,
        whose blocks span every rank's pool). ``layers``: ``data`` holds only layers
        ``[lo, hi)`` of each block (a tensor; a layer-wise stream's piece)."""
        ids = check_block_ids(block_ids, self._pool.shape[0])
        stray = sorted(set(ids) - set(self.block_ids))
        if stray:
            raise ValueError(f"block ids {stray[:8]} are not in the reservation")
        if writer is not None:
            if layers is not None:
                raise ValueError("a writer takes whole blocks, not a layer range")
            if not isinstance(data, bytes | bytearray | memoryview):
                raise ValueError("a writer takes raw block bytes")
            with self._mu:
                if self._state != RESERVED:
                    raise TransferError(f"{self!r} already ended")
                writer(ids, bytes(data))
            return ids
        if isinstance(data, bytes | bytearray | memoryview):
            if layers is not None:
                raise ValueError("a layer range is written from a tensor")
            data = buffer_from_bytes(self._pool, len(ids), bytes(data))
        with self._mu:
            if self._state != RESERVED:
                raise TransferError(f"{self!r} already ended")
            scatter(self._pool, ids, data, layers)
        return ids

    def fill(self, buffer: torch.Tensor) -> bool:
        """Write every reserved block from ``buffer`` and end as done; False (nothing written)
        if the reservation already ended."""
        with self._mu:
            if self._state != RESERVED:
                return False
            scatter(self._pool, list(self.block_ids), buffer)
            self._end(DONE, None)
            return True

    def fill_in_place(self, write: Callable[[], None]) -> bool:
        """Hold the reservation while ``write()`` writes its blocks in place (a tensor-parallel
        engine's ranks, each into its own pool: ``transfer.shards``), then end it done. False
        (``write`` not called) if it already ended. Ending it otherwise (``cancel``) waits
        until ``write`` returns; should ``write`` raise, the reservation fails with that error,
        which is raised."""
        with self._mu:
            if self._state != RESERVED:
                return False
            try:
                write()
            except BaseException as exc:
                self._end(FAILED, exc)
                raise
            self._end(DONE, None)
            return True

    def end_done(self) -> None:
        """End as done (every block is in); nothing if it already is, its failure raised if it
        ended otherwise."""
        with self._mu:
            if self._state != RESERVED:
                self.result()  # raises unless done
                return
            self._end(DONE, None)

    def end_failed(self, error: BaseException) -> bool:
        """End as failed with ``error``; False if it had already ended."""
        with self._mu:
            if self._state != RESERVED:
                return False
            self._end(FAILED, error)
            return True

    def end_cancelled(self) -> bool:
        """End as cancelled; False if it had already ended."""
        with self._mu:
            if self._state != RESERVED:
                return False
            self._end(CANCELLED, TransferError(f"reservation for {self.peer_id!r} cancelled"))
            return True

    def _end(self, state: str, error: BaseException | None) -> None:
        self._state = state
        self._error = error
        self._ended.set()
