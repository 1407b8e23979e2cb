"""Does a frequency term pay in the host tier's eviction? A simulation of the KV pool and the host
tier behind it under the conversation workload (``splitserve bench --workload conversation``'s
generator: conversations of 2-8 turns, each turn's prompt the history so far plus a question, a
finished conversation replaced by a new one, the next turn's conversation drawn at random), with
the tier evicting by LRU (as it does) or by a segmented LRU (a block hit in the tier moves to a
protected segment of ``--protected`` of its size; blocks seen once are evicted first).

    python benchmarks/tier_eviction.py --conversations 256 --requests 8000 \\
        --pool-blocks 1024 --host-blocks 4096 8192 16384

The pool is LRU over blocks no running request holds, as the engine's ``BlockPool``; every block
computed is copied to the tier (write-through); a prompt is looked up in the pool, then the tier,
and the rest computed. No model, no timing: the prompt tokens computed against those new in each
turn, per policy and tier size. Requests run one at a time (a real pool also holds the running
requests' blocks: this is the tier's policy alone).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

from splitserve.bench import workloads
from splitserve.kvstore import hash_request_tokens

BLOCK = 16


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.entries = capacity, OrderedDict()

    def __contains__(self, h) -> bool:
        return h in self.entries

    def hit(self, h) -> None:
        self.entries.move_to_end(h)

    def add(self, h) -> None:
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        if len(self.entries) >= self.capacity:
            self.entries.popitem(last=False)
        self.entries[h] = None


class SegmentedLRU:
    """Probation (seen once) and protected (hit since it came in, at most ``share`` of the size);
    evicts from probation first; a protected block pushed out goes back to probation's end."""

    def __init__(self, capacity: int, share: float) -> None:
        self.capacity = capacity
        self.max_protected = max(1, int(capacity * share))
        self.probation, self.protected = OrderedDict(), OrderedDict()

    def __contains__(self, h) -> bool:
        return h in self.probation or h in self.protected

    def hit(self, h) -> None:
        if h in self.protected:
            self.protected.move_to_end(h)
            return
        del self.probation[h]
        self.protected[h] = None
        if len(self.protected) > self.max_protected:
            old, _ = self.protected.popitem(last=False)
            self.probation[old] = None

    def add(self, h) -> None:
        if h in self:
            self.hit(h)
            return
        if len(self.probation) + len(self.protected) >= self.capacity:
            victim = self.probation if self.probation else self.protected
            victim.popitem(last=False)
        self.probation[h] = None


def simulate(requests, pool_blocks: int, tier) -> tuple[int, int, int]:
    """(prompt tokens, computed, from the tier)."""
    pool = LRU(pool_blocks)
    prompt = computed = from_tier = 0
    for tokens in requests:
        hashes = hash_request_tokens(list(tokens), BLOCK, b"r" * 32)
        usable = (len(tokens) - 1) // BLOCK  # the last token is always computed
        n = 0
        while n < usable and hashes[n] in pool:
            pool.hit(hashes[n])
            n += 1
        m = n
        while m < usable and hashes[m] in tier:
            tier.hit(hashes[m])
            m += 1
        for h in hashes[n:]:
            pool.add(h)
        for h in hashes[m:]:
            tier.add(h)  # computed: written through
        prompt += len(tokens)
        computed += len(tokens) - m * BLOCK
        from_tier += (m - n) * BLOCK
    return prompt, computed, from_tier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--pool-blocks", type=int, default=1024)
    ap.add_argument("--host-blocks", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--protected", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = workloads.conversation(args.conversations, None, text=False, vocab=250, seed=args.seed)
    requests = [next(gen).prompt for _ in range(args.requests)]
    total = sum(len(r) for r in requests)
    print(
        f"{args.requests:,} requests of {args.conversations} conversations at once, "
        f"{total:,} prompt tokens; pool {args.pool_blocks:,} blocks"
    )
    print("\n| host tier blocks | policy | computed | from the tier | computed vs LRU |")
    print("|---|---|---|---|---|")
    for host in args.host_blocks:
        _, base, tier_lru = simulate(requests, args.pool_blocks, LRU(host))
        rows = [("LRU", base, tier_lru)]
        for share in args.protected:
            _, c, t = simulate(requests, args.pool_blocks, SegmentedLRU(host, share))
            rows.append((f"segmented LRU, {share:.0%} protected", c, t))
        for name, c, t in rows:
            print(f"| {host:,} | {name} | {c:,} ({c / total:.1%}) | {t:,} | {c / base:.3f}x |")


if __name__ == "__main__":
    main()
