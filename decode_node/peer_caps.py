"""Per-peer caps on a decode node: how many transfers, and how many KV blocks in those transfers,
one sending node may have here at once.

A transfer takes its sender's share when its header is accepted (``PeerCaps.admit``) and gives
it back once, whatever ends it (``PeerHold.release``: adopted, failed, cancelled, given up at a
deadline). A peer is its header's ``sender_id`` (the sending node's transfer-layer id), or the
connection's host for a sender that names none. Blocks are counted from the header (every
block of the prompt, the partial tail included, cached here or not) until the transfer ends;
once adopted, a request's blocks wait for the router's decode command under the node's own
``--transfer-deadline-s`` and are no longer its sender's.

NOTE: a peer's first transfer is always let through whatever its size (the node still refuses a
prompt larger than its whole pool): a cap below one long prompt would otherwise refuse it from a
single prefill node feeding this one, where no other peer needs the blocks. The caps bound what
one peer holds beyond that, so several live senders cannot fill the node between them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from splitserve.decode_node.header import TransferRefused
from splitserve.runtime import counter_names as names
from splitserve.runtime.failure import Failure

MAX_PEER_ID_CHARS = 256  # a sender id is input from another node: bounded before it is a key


@dataclass(frozen=True, slots=True)
class PeerLimits:
    """What one peer may hold here at once: ``max_transfers`` transfers holding at most
    ``max_blocks`` KV blocks between them (beyond its first transfer, see the module's NOTE)."""

    max_transfers: int
    max_blocks: int

    def __post_init__(self) -> None:
        if self.max_transfers < 1 or self.max_blocks < 1:
            raise ValueError(f"peer limits must be >= 1, got {self}")

    @classmethod
    def of_node(cls, max_transfers: int, kv_share: float, usable_blocks: int) -> PeerLimits:
        """The limits of a node with ``usable_blocks`` KV blocks: ``kv_share`` of them."""
        return cls(max_transfers, max(1, int(kv_share * usable_blocks)))


@dataclass(slots=True)
class _Held:
    transfers: int = 0
    blocks: int = 0


class PeerCaps:
    """The transfers and blocks each peer holds on this node (only peers holding some)."""

    def __init__(self, limits: PeerLimits, counters: Counter[str]) -> None:
        self.limits = limits
        self.counters = counters
        self._held: dict[str, _Held] = {}

    def held(self, peer: str) -> tuple[int, int]:
        """(transfers, blocks) ``peer`` holds now."""
        held = self._held.get(peer)
        return (held.transfers, held.blocks) if held is not None else (0, 0)

    @property
    def num_peers(self) -> int:
        """Peers holding at least one transfer."""
        return len(self._held)

    def admit(self, peer: str, num_blocks: int) -> PeerHold:
        """Take one transfer of ``num_blocks`` blocks for ``peer``; ``TransferRefused`` with
        RESOURCE_EXHAUSTED, naming the limit and the option that raises it, beyond its caps."""
        if len(peer) > MAX_PEER_ID_CHARS:
            raise TransferRefused(
                Failure.INVALID,
                f"sender_id is over {MAX_PEER_ID_CHARS} characters",
            )
        held = self._held.get(peer) or _Held()
        limits = self.limits
        if held.transfers >= limits.max_transfers:
            self.counters[names.TRANSFERS_REFUSED_PEER_TRANSFERS] += 1
            raise TransferRefused(
                Failure.REFUSED,
                f"sender {peer!r} already has {held.transfers} transfers in flight to this decode "
                f"node, its limit (raise it with the decode node's --max-transfers-per-peer); "
                "retry on another node",
            )
        if held.transfers and held.blocks + num_blocks > limits.max_blocks:
            self.counters[names.TRANSFERS_REFUSED_PEER_BLOCKS] += 1
            raise TransferRefused(
                Failure.REFUSED,
                f"sender {peer!r} holds {held.blocks} KV blocks in transfers to this decode node; "
                f"{num_blocks} more would pass its limit of {limits.max_blocks} (raise it with the "
                "decode node's --max-kv-share-per-peer); retry on another node",
            )
        held.transfers += 1
        held.blocks += num_blocks
        self._held[peer] = held
        return PeerHold(self, peer, num_blocks)

    def _give_back(self, peer: str, num_blocks: int) -> None:
        held = self._held[peer]
        held.transfers -= 1
        held.blocks -= num_blocks
        assert held.transfers >= 0 and held.blocks >= 0, (peer, held)
        if not held.transfers:
            del self._held[peer]  # the table holds only peers with transfers in flight


class PeerHold:
    """One transfer's share of its peer's caps; ``release`` gives it back, once."""

    __slots__ = ("_caps", "_released", "num_blocks", "peer")

    def __init__(self, caps: PeerCaps, peer: str, num_blocks: int) -> None:
        self._caps = caps
        self.peer = peer
        self.num_blocks = num_blocks
        self._released = False

    def release(self) -> None:
        """Idempotent: only the first call gives the share back."""
        if self._released:
            return
        self._released = True
        self._caps._give_back(self.peer, self.num_blocks)
