"""The shares of one decode node that its routers may fill (``RelayLease`` / ``RelayGrant``).

Each router with a ``Relay`` stream here is a holder. It says what share of the node it would
like (``want``) and what its requests hold now (``used``); the book grants shares so that what
every router may count on never adds up to more than the whole node:

- the targets are a max-min fair split of the whole among the wants (a router wanting less than
  an equal part gets what it wants, the rest is split evenly among the others), and what no one
  wants is split evenly among all (a router alone gets the whole node before it asks);
- a grant above its target shrinks at once (the router stops admitting past it as soon as it
  reads it), but the node keeps counting the larger grant until the router says it has seen the
  smaller one (``seen``), and counts the router's ``used`` while that is more: capacity a router
  may still be filling, or whose requests still hold it, is never granted to another;
- a grant below its target grows only out of what no holder counts on, the smallest grants
  first.

So the sum of the holders' counted shares stays within the whole at every moment, whatever
order the messages cross in. Pure bookkeeping: ``DecodeService`` owns one, its relay streams
feed it, and each grant that changed is sent on its holder's stream.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.runtime.protocol import LEASE_WHOLE as WHOLE  # parts per million: the node


class Holder:
    """One router's lease (its Relay stream's): what it wants and uses, what it was granted."""

    __slots__ = ("_sent", "granted", "on_grant", "seen", "seq", "speaks", "used", "want")

    def __init__(self, on_grant: Callable[[Holder], None]) -> None:
        self.want = 0
        self.used = 0
        self.granted = 0  # the last grant sent
        self.seq = 0  # its sequence number (0: none sent yet)
        self.seen = 0  # the last grant the router said it applied
        self._sent: list[tuple[int, int]] = []  # (seq, share) of the grants since ``seen``
        self.on_grant = on_grant  # called after each new grant (its stream sends it)
        # It sent a lease: a router that never does (it does not know leases) is granted nothing,
        # so no share waits for ever on an acknowledgement it will not send.
        self.speaks = False

    def counted(self) -> int:
        """What the node counts this router on: the largest grant it may still act on, or its
        requests' hold when that is more."""
        acting = max((share for seq, share in self._sent if seq >= self.seen), default=0)
        return max(acting, self.used)

    def _grant(self, share: int) -> None:
        self.seq += 1
        self.granted = share
        self._sent.append((self.seq, share))
        self.on_grant(self)

    def _saw(self, seen: int) -> None:
        """The router applied grant ``seen``: the ones before it no longer count."""
        if self.seen < seen <= self.seq:
            self.seen = seen
            self._sent = [(seq, share) for seq, share in self._sent if seq >= seen]


def fair_targets(wants: list[int], whole: int = WHOLE) -> list[int]:
    """A max-min fair split of ``whole`` among ``wants`` (each gets at most its want), then
    what no one wants split evenly among all: nothing of the node idles unleased (a router
    alone on a node may fill all of it at once, one that wants more takes it back from the
    others' spare part)."""
    order = sorted(range(len(wants)), key=wants.__getitem__)
    targets = [0] * len(wants)
    left = whole
    for rank, i in enumerate(order):
        level = left // (len(wants) - rank)
        share = min(wants[i], level)
        targets[i] = share
        left -= share
    if targets and left > 0:
        each, extra = divmod(left, len(targets))
        for rank, i in enumerate(order):
            targets[i] += each + (1 if rank < extra else 0)
    return targets


class LeaseBook:
    """Every router's lease on this node."""

    def __init__(self, whole: int = WHOLE) -> None:
        self.whole = whole
        self.holders: list[Holder] = []

    def join(self, on_grant: Callable[[Holder], None]) -> Holder:
        holder = Holder(on_grant)
        self.holders.append(holder)
        return holder

    def leave(self, holder: Holder) -> None:
        """The router's stream ended (the node ended its requests): its share is free."""
        if holder in self.holders:
            self.holders.remove(holder)
            self.rebalance()

    def update(self, holder: Holder, want: int, used: int, seen: int) -> None:
        """A lease message from ``holder``'s router (values clamped to the whole: input)."""
        holder.speaks = True
        holder.want = min(max(want, 0), self.whole)
        holder.used = min(max(used, 0), self.whole)
        holder._saw(seen)
        self.rebalance()

    def counted(self) -> int:
        return sum(h.counted() for h in self.holders)

    def rebalance(self) -> None:
        holders = [h for h in self.holders if h.speaks]
        targets = fair_targets([h.want for h in holders], self.whole)
        for holder, target in zip(holders, targets, strict=True):
            if holder.granted > target:
                holder._grant(target)
        free = self.whole - self.counted()
        growing = sorted(
            (h.granted, i)
            for i, (h, t) in enumerate(zip(holders, targets, strict=True))
            if h.granted < t
        )
        for _, i in growing:
            holder, target = holders[i], targets[i]
            counted = holder.counted()  # its own, even with nothing free: what its requests hold
            share = min(target, counted + max(free, 0))
            if share > holder.granted:
                holder._grant(share)
                free -= max(0, share - counted)
