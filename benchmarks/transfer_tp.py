"""KV rank to rank between tensor-parallel pools (transfer/shards.py), the data plane alone.

    python benchmarks/transfer_tp.py --device cuda --pairs 2x2 1x2 2x1 --blocks 16 256
    python benchmarks/transfer_tp.py --device cpu --pairs 1x1 2x2 1x2 --blocks 16 --small

A sending pool at tensor parallel size p and a receiving pool at size d, one process per rank in
one group (gloo on CPU; NCCL on CUDA, a GPU per rank: p + d GPUs, receiver ranks on the first
ones), the way two nodes' ranks are grouped by the dist path. Blocks of Llama-3-8B's KV shape
(32 layers, 8 KV heads, head_dim 128, block size 16, bf16: 2 MiB a whole block; ``--small``:
2 layers, 4 KV heads, head_dim 64) move from random source blocks into random destination
blocks, every sender rank sending its pieces of the plan and every receiver rank taking its own.
One warm-up transfer, then ``--repeats`` timed ones, each from a barrier of every rank until the
last receiver rank has its blocks in its pool (a second barrier): the table has the median time
and GB/s (10^9 bytes of whole blocks) of the median and best. Every case checks every received
head against what its sender held.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.multiprocessing as mp


class Shape(NamedTuple):
    layers: int
    heads: int
    head_dim: int
    block: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:  # a whole block: every KV head
        return self.layers * 2 * self.block * self.heads * self.head_dim * self.dtype.itemsize


FULL = Shape(layers=32, heads=8, head_dim=128, block=16, dtype=torch.bfloat16)
SMALL = Shape(layers=2, heads=4, head_dim=64, block=16, dtype=torch.bfloat16)


def _marks(pool: torch.Tensor, heads: range, ids: list[int]) -> None:
    """Write into blocks ``ids`` a value per (block, global head) that a receiver can recompute."""
    for b in ids:
        for j, h in enumerate(heads):
            pool[b, :, :, :, j, :] = float((b * 131 + h * 7) % 1000)


def _worker(rank: int, args, port: int, results) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    from splitserve.kvstore.tp_shards import kv_heads_of
    from splitserve.transfer.dist.group import make_group
    from splitserve.transfer.shards import ShardGroup, receive_shards, send_shards

    shape = SMALL if args.small else FULL
    p, d, n = args.p, args.d, args.n
    group = ShardGroup(shape.heads, p, d)
    receiving = rank < d
    tp_rank = rank if receiving else rank - d
    heads = kv_heads_of(shape.heads, d if receiving else p, tp_rank)
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    num_blocks = n + 2
    pool = torch.zeros(
        (num_blocks, shape.layers, 2, shape.block, len(heads), shape.head_dim),
        dtype=shape.dtype,
        device=device,
    )
    rng = random.Random(7)  # the same draws on every rank
    src = rng.sample(range(1, num_blocks), n)
    dst = rng.sample(range(1, num_blocks), n)
    if not receiving:
        _marks(pool, heads, src)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    backend = "nccl" if device.type == "cuda" else "gloo"
    pg = make_group(store, rank, group.size, backend, 120.0, "127.0.0.1")

    def barrier() -> None:
        flag = torch.ones(1, device=device)
        pg.allreduce([flag]).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(args.repeats + 1):
        barrier()
        start = time.perf_counter()
        if receiving:
            receive_shards(pg, group, tp_rank, pool, dst, tag=i, timeout_s=120)
        else:
            send_shards(pg, group, tp_rank, pool, src, tag=i, timeout_s=120)
        barrier()
        if i:
            times.append(time.perf_counter() - start)
    ok = True
    if receiving:
        expect = torch.zeros_like(pool)
        for s, t in zip(src, dst, strict=True):
            for j, h in enumerate(heads):
                expect[t, :, :, :, j, :] = float((s * 131 + h * 7) % 1000)
        ok = bool(torch.equal(pool, expect))
    results[rank] = (times, ok)


def run_case(args) -> tuple[list[float], bool]:
    from splitserve.transfer.dist.group import loopback_store

    store, port = loopback_store(120.0)
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    size = args.p + args.d
    procs = [ctx.Process(target=_worker, args=(r, args, port, results)) for r in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
    del store
    if len(results) != size:
        raise RuntimeError(f"{size - len(results)} ranks did not finish (see their output)")
    times = results[0][0]
    return times, all(results[r][1] for r in range(size))


def main() -> int:
    ap = argparse.ArgumentParser(description="KV rank to rank between tensor-parallel pools")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--pairs", nargs="+", default=["1x1", "2x2", "1x2", "2x1"], help="PxD sizes")
    ap.add_argument("--blocks", nargs="+", type=int, default=[16, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a small block shape (CPU checks)")
    args = ap.parse_args()
    shape = SMALL if args.small else FULL
    block_bytes = shape.block_bytes
    rows = []
    for pair in args.pairs:
        p, d = (int(x) for x in pair.split("x"))
        if args.device == "cuda" and p + d > torch.cuda.device_count():
            print(f"skip {pair}: needs {p + d} GPUs, {torch.cuda.device_count()} visible")
            continue
        for n in args.blocks:
            args.p, args.d, args.n = p, d, n
            times, ok = run_case(args)
            med, best = statistics.median(times), min(times)
            gb = n * block_bytes / 1e9
            rows.append((pair, n, med * 1e3, gb / med, gb / best, "yes" if ok else "NO"))
    kind = "small" if args.small else "8B"
    print(f"\nKV rank to rank ({args.device}, {kind} blocks of {block_bytes / 2**20:.2f} MiB "
          f"whole; torch {torch.__version__})")  # fmt: skip
    print("| P x D | blocks | median ms | GB/s median | GB/s best | exact |")
    print("|---|---|---|---|---|---|")
    for pair, n, ms, med, best, ok in rows:
        print(f"| {pair} | {n} | {ms:.2f} | {med:.2f} | {best:.2f} | {ok} |")
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
