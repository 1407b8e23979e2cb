"""What the router lets each decode node's KV hold: a ledger of the blocks its requests will need.

A request is sent to a prefill node only once its decode node D can hold its KV: otherwise P would
compute a prompt whose blocks have nowhere to go (D's transfer would wait for blocks, then fail,
and the prompt be computed again elsewhere). The router counts, per D, the blocks of the requests
it has sent there and not yet seen end:

- the prompt's full blocks, by hash (``kvstore.hash_request_tokens``): requests sharing a prefix
  share those blocks on D (a second transfer of the same hashes reuses the first's), so a hash
  held by any in-flight request is counted once;
- its private blocks: the partial tail and the output it may write, ``min(max_tokens,
  reserve_tokens)`` tokens up front, more as its output actually grows past that (``grow``).

A request fits D when the ledger plus what the request adds stays within D's usable blocks less a
headroom (blocks the ledger cannot see: two direct-route prefills of one new prefix computing it
twice, an ipc transfer's quarantined blocks); a request too large for that fits an empty D if its
prompt alone fits. D's cached prefix blocks no request holds are evictable, so they count as free.

Why a ledger rather than D's published free-block figure: those figures are seconds old, and a
burst admits hundreds of requests in milliseconds; the ledger moves with every admission. With
several routers in front of one decode pool each sees only its own requests: each then fills only
the share of D that D's lease grants it (``decode_node.leases``; ``share`` here, set by
``Node.apply_share``), so together they never charge more than D holds; D's own reservation wait
(``decode_node.receiver``) remains the backstop for what the ledgers cannot see (a prefix two
routers both charge, a request larger than its router's share going alone).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.kvstore import hash_request_tokens

LEDGER_ROOT = bytes(32)  # any fixed root: the ledger compares hashes of one router's requests


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(slots=True, eq=False)
class KVDemand:
    """The blocks one request needs on its decode node: ``hashes`` of its full prompt blocks
    (shared with other requests holding the same ones) and ``private_blocks`` of its own (tail
    and output, as charged now)."""

    hashes: tuple[bytes, ...]
    prompt_tokens: int
    private_blocks: int
    block_size: int

    @classmethod
    def of(
        cls,
        prompt_token_ids: Sequence[int],
        cache_salt: str,
        max_tokens: int,
        block_size: int,
        reserve_tokens: int,
        hashes: Sequence[bytes] | None = None,
    ) -> KVDemand:
        """``hashes``: the prompt's block hashes (with ``cache_salt``) when the caller has them
        (any root will do: the ledger compares them with each other only); else hashed here."""
        if hashes is None:
            hashes = hash_request_tokens(
                prompt_token_ids, block_size, LEDGER_ROOT, cache_salt or None
            )
        n = len(prompt_token_ids)
        output = min(max_tokens, reserve_tokens)
        return cls(tuple(hashes), n, _private(n, output, block_size), block_size)

    @property
    def prompt_blocks(self) -> int:
        return blocks_for(self.prompt_tokens, self.block_size)

    @property
    def total_blocks(self) -> int:
        """Blocks this request alone needs (nothing shared)."""
        return len(self.hashes) + self.private_blocks


def _private(prompt_tokens: int, output_tokens: int, block_size: int) -> int:
    """Blocks past the prompt's full ones: the tail and ``output_tokens`` of output."""
    full = prompt_tokens // block_size
    return blocks_for(prompt_tokens + output_tokens, block_size) - full


class KVLedger:
    """One decode node's blocks as the router charges them (pure bookkeeping)."""

    def __init__(self, headroom: float = 0.0, share: float = 1.0) -> None:
        self.num_blocks: int | None = None  # D's usable blocks, once its GetStats answered
        self.headroom = headroom  # share of num_blocks kept out of the ledger's reach
        self.share = share  # of the rest, the share this router fills (--capacity-share)
        self._shared: Counter[bytes] = Counter()  # prompt block hash → requests holding it
        self._private = 0

    @property
    def used(self) -> int:
        """Blocks charged: each shared hash once, plus every request's private blocks."""
        return len(self._shared) + self._private

    def whole(self) -> float:
        """The blocks every router together may charge (0: not known)."""
        return (self.num_blocks or 0) * (1.0 - self.headroom)

    @property
    def limit(self) -> int | None:
        if self.num_blocks is None:
            return None
        return max(int(self.whole() * self.share), 1)

    # NOTE: a request's hashes are distinct (each chains its parent), so no set is needed.

    def added(self, demand: KVDemand) -> int:
        """Blocks ``demand`` would add to the ledger now."""
        new = sum(1 for h in demand.hashes if h not in self._shared)
        return new + demand.private_blocks

    def fits(self, demand: KVDemand) -> bool:
        limit = self.limit
        if limit is None:
            return True  # capacity not known yet: the sequence cap alone applies
        if self.used + self.added(demand) <= limit:
            return True
        # Larger than the budget but not than the node: it goes alone.
        return self.used == 0 and demand.prompt_blocks <= (self.num_blocks or 0)

    def can_ever_fit(self, demand: KVDemand) -> bool:
        """False when the prompt alone is larger than the whole node."""
        return self.num_blocks is None or demand.prompt_blocks <= self.num_blocks

    def take(self, demand: KVDemand) -> None:
        self._shared.update(demand.hashes)
        self._private += demand.private_blocks

    def give_back(self, demand: KVDemand) -> None:
        shared = self._shared
        for h in demand.hashes:
            n = shared.get(h, 0)
            if n > 1:
                shared[h] = n - 1
            else:
                shared.pop(h, None)
        self._private -= demand.private_blocks
        assert self._private >= 0, "gave back more private blocks than were taken"

    def grow(self, demand: KVDemand, output_tokens: int) -> None:
        """The request has written ``output_tokens`` (on a node where ``take`` charged it):
        charge the blocks its output now fills beyond its reserve."""
        private = _private(demand.prompt_tokens, output_tokens + 1, demand.block_size)
        if private > demand.private_blocks:
            self._private += private - demand.private_blocks
            demand.private_blocks = private
