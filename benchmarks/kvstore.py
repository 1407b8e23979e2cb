"""kvstore throughput on one CPU core: block allocation/free and block hashing.

    python benchmarks/kvstore.py [--blocks-per-request 128] [--repeat 7]

Prints a table: the median of ``--repeat`` timed rounds, all benches interleaved round by round.
Two CPython baselines run beside the real code on the same machine, so that figures from machines
of different speed can be compared: a bare doubly linked free list (pop + append, no
bookkeeping) and the textbook hash step ``sha256(msgpack.packb([parent, token_list, extra]))``.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

# NOTE: this file's name shadows the kvstore package when run as a script; drop its folder from
# the import path so that `import kvstore` finds the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from splitserve.kvstore import BlockPool, KVCacheManager, ModelIdentity, hash_request_tokens  # noqa: E402

Bench = tuple[Callable[[], None], int]  # (one timed round, units of work it does)


def measure(benches: dict[str, Bench], repeat: int) -> dict[str, list[float]]:
    """Rates of every bench over ``repeat`` rounds, interleaved so that all of them see the same
    machine (shared virtual machines drift by up to 2x over seconds)."""
    for run, _ in benches.values():
        run()  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in benches}
    for _ in range(repeat):
        for name, (run, work) in benches.items():
            t0 = time.perf_counter()
            run()
            rates[name].append(work / (time.perf_counter() - t0))
    return rates


def bench_pool(n: int, rounds: int, events: bool = False) -> Bench:
    """get_new_blocks(n) + cache_full_blocks + free_blocks(tail first): every allocated block was a
    cached prefix, so every allocation also evicts (hash map delete) and every free re-queues."""
    pool = BlockPool(8 * n + 1, enable_events=events)
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
            if events:
                pool.take_events()

    return run, n * rounds


def bench_manager(n: int, rounds: int) -> Bench:
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

    return run, n * rounds


def bench_bare_list(n: int, rounds: int) -> Bench:
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

    return run, n * rounds


def bench_hash(n: int, rounds: int) -> Bench:
    root = ModelIdentity("bench").root_hash
    prompts = [[random.randrange(128_000) for _ in range(n * 16)] for _ in range(8)]

    def run():
        for r in range(rounds):
            hash_request_tokens(prompts[r % 8], 16, root, cache_salt="tenant")

    return run, n * 16 * rounds


def bench_hash_textbook(n: int, rounds: int) -> Bench:
    """Baseline: sha256(msgpack.packb([parent, list of 16 ints, extra])) per block."""
    root = ModelIdentity("bench").root_hash
    prompts = [[random.randrange(128_000) for _ in range(n * 16)] for _ in range(8)]
    packb, sha256 = msgpack.packb, hashlib.sha256

    def run():
        for r in range(rounds):
            tokens, parent = prompts[r % 8], root
            for i in range(n):
                parent = sha256(packb([parent, tokens[i * 16 : (i + 1) * 16], None])).digest()

    return run, n * 16 * rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks-per-request", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=400, help="requests per timed round")
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds (median reported)")
    args = ap.parse_args()
    n, rounds, repeat = args.blocks_per_request, args.rounds, args.repeat

    benches = {
        "pool": bench_pool(n, rounds),
        "pool+events": bench_pool(n, rounds, events=True),
        "manager": bench_manager(n, rounds),
        "bare": bench_bare_list(n, rounds),
        "hash": bench_hash(n, rounds // 4),
        "textbook": bench_hash_textbook(n, rounds // 4),
    }
    rates = {name: statistics.median(r) for name, r in measure(benches, repeat).items()}
    rows = [
        ("BlockPool alloc+cache+free (evicting)", "pool", "blocks/s", 2_000_000, "bare"),
        ("  same, stored/removed events on", "pool+events", "blocks/s", None, "bare"),
        ("KVCacheManager request life cycle", "manager", "blocks/s", 2_000_000, "bare"),
        ("baseline: bare linked list pop+append", "bare", "blocks/s", None, None),
        ("hash_request_tokens (salted)", "hash", "tokens/s", 8_000_000, "textbook"),
        ("baseline: sha256(msgpack(list)) per block", "textbook", "tokens/s", None, None),
    ]
    print(
        f"# kvstore, {n} blocks (block_size 16) per request; python {platform.python_version()}"
        f" on {platform.machine()}, one thread; median of {repeat} interleaved rounds"
    )
    print(f"{'what':42s} {'rate':>12s} {'unit':9s} {'vs baseline':>11s} {'target':>10s}  met")
    for what, key, unit, target, base in rows:
        rate = rates[key]
        ratio = f"{rate / rates[base]:.2f}x" if base else "-"
        tgt = f"{target:,}" if target else "-"
        met = "-" if target is None else ("yes" if rate >= target else "NO")
        print(f"{what:42s} {rate:12,.0f} {unit:9s} {ratio:>11s} {tgt:>10s}  {met}")


if __name__ == "__main__":
    main()
