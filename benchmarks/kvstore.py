"""kvstore throughput on one CPU core: block allocation/free and block hashing.

    python benchmarks/kvstore.py [--blocks-per-request 128] [--repeat 7]

Prints a table: the median and the best of ``--repeat`` timed rounds (shared virtual machines
vary by up to 2x between rounds; the best round is the least disturbed one). Two CPython baselines
run beside the real code on the same machine, so that figures from machines of different speed
can be compared: a bare doubly linked free list (pop + append, no bookkeeping) and the textbook
hash step ``sha256(msgpack.packb([parent, token_list, extra]))``.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import random
import statistics
import time

import msgpack

from kvstore import BlockPool, KVCacheManager, ModelIdentity, hash_request_tokens


def _median_rate(fn, work: int, repeat: int) -> tuple[float, float]:
    """(median, best) rate over ``repeat`` timed rounds after one warm-up round."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return work / statistics.median(times), work / min(times)


def bench_pool(n: int, rounds: int, repeat: int) -> tuple[float, float]:
    """get_new_blocks(n) + cache_full_blocks + free_blocks(tail first): every allocated block was a
    cached prefix, so every allocation also evicts (hash map delete) and every free re-queues."""
    pool = BlockPool(8 * n + 1)
    root = ModelIdentity("bench").root_hash
    hash_sets = [
        hash_request_tokens([random.randrange(128_000) for _ in range(n * 16)], 16, root)
        for _ in range(16)
    ]

    def run():
        for r in range(rounds):
            blocks = pool.get_new_blocks(n)
            pool.cache_full_blocks(blocks, hash_sets[r % 16], 0, n)
            blocks.reverse()
            pool.free_blocks(blocks)

    return _median_rate(run, n * rounds, repeat)


def bench_manager(n: int, rounds: int, repeat: int) -> tuple[float, float]:
    """A request's whole life in the manager: lookup (miss), allocate_slots, cache_blocks, free."""
    mgr = KVCacheManager(BlockPool(8 * n + 1), 16)
    root = ModelIdentity("bench").root_hash
    hash_sets = [
        hash_request_tokens([random.randrange(128_000) for _ in range(n * 16)], 16, root)
        for _ in range(16)
    ]

    def run():
        for r in range(rounds):
            hashes = hash_sets[r % 16]
            computed = mgr.get_computed_blocks(hashes[:0], n * 16)
            mgr.allocate_slots("r", n * 16, computed)
            mgr.cache_blocks("r", hashes, n * 16)
            mgr.free("r")

    return _median_rate(run, n * rounds, repeat)


def bench_bare_list(n: int, rounds: int, repeat: int) -> tuple[float, float]:
    """Baseline: a bare doubly linked list of slotted nodes, popleft n then append n."""

    class Node:
        __slots__ = ("next", "prev")

    head, tail = Node(), Node()
    nodes = [Node() for _ in range(8 * n)]
    prev = head
    for node in [*nodes, tail]:
        prev.next, node.prev = node, prev
        prev = node

    def run():
        for _ in range(rounds):
            out = []
            cur = head.next
            for _ in range(n):
                out.append(cur)
                nxt = cur.next
                cur.prev = cur.next = None
                cur = nxt
            head.next, cur.prev = cur, head
            last = tail.prev
            for node in out:
                node.prev, last.next = last, node
                last = node
            last.next, tail.prev = tail, last

    return _median_rate(run, n * rounds, repeat)


def bench_hash(n: int, rounds: int, repeat: int) -> tuple[float, float]:
    root = ModelIdentity("bench").root_hash
    prompts = [[random.randrange(128_000) for _ in range(n * 16)] for _ in range(8)]

    def run():
        for r in range(rounds):
            hash_request_tokens(prompts[r % 8], 16, root, cache_salt="tenant")

    return _median_rate(run, n * 16 * rounds, repeat)


def bench_hash_textbook(n: int, rounds: int, repeat: int) -> tuple[float, float]:
    """Baseline: sha256(msgpack.packb([parent, list of 16 ints, extra])) per block."""
    root = ModelIdentity("bench").root_hash
    prompts = [[random.randrange(128_000) for _ in range(n * 16)] for _ in range(8)]
    packb, sha256 = msgpack.packb, hashlib.sha256

    def run():
        for r in range(rounds):
            tokens, parent = prompts[r % 8], root
            for i in range(n):
                parent = sha256(packb([parent, tokens[i * 16 : (i + 1) * 16], None])).digest()

    return _median_rate(run, n * 16 * rounds, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks-per-request", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=400, help="requests per timed round")
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds (median reported)")
    args = ap.parse_args()
    n, rounds, repeat = args.blocks_per_request, args.rounds, args.repeat

    rows = [
        (
            "BlockPool alloc+cache+free (evicting)",
            "blocks/s",
            bench_pool(n, rounds, repeat),
            2_000_000,
        ),
        (
            "KVCacheManager request life cycle",
            "blocks/s",
            bench_manager(n, rounds, repeat),
            2_000_000,
        ),
        (
            "baseline: bare linked list pop+append",
            "blocks/s",
            bench_bare_list(n, rounds, repeat),
            None,
        ),
        ("hash_request_tokens (salted)", "tokens/s", bench_hash(n, rounds // 4, repeat), 8_000_000),
        (
            "baseline: sha256(msgpack(list)) per block",
            "tokens/s",
            bench_hash_textbook(n, rounds // 4, repeat),
            None,
        ),
    ]
    print(
        f"# kvstore, {n} blocks (block_size 16) per request; python {platform.python_version()}"
        f" on {platform.machine()}, one thread"
    )
    print(f"{'what':44s} {'median':>12s} {'best':>12s} {'unit':9s} {'target':>10s}  median met")
    for what, unit, (median, best), target in rows:
        tgt = f"{target:,}" if target else "-"
        met = "-" if target is None else ("yes" if median >= target else "NO")
        print(f"{what:44s} {median:12,.0f} {best:12,.0f} {unit:9s} {tgt:>10s}  {met}")


if __name__ == "__main__":
    main()
