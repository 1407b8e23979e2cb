"""Shared-prefix workload with the Redis prefix index off vs on, on the same cluster shape.

    python benchmarks/prefix.py [--requests 64] [--prompt-len 320] [--shared 0.9]
    python benchmarks/prefix.py --device cuda --make-8b /tmp/llama8b --prompt-len 4096

One request warms the cache with the shared prefix, then ``--requests`` requests that share
``--shared`` of their prompt are sent at once through the SDK. Reported per mode: mean and p99
time to first token, and the prefill tokens computed (prompt tokens minus the cached ones the
nodes report). Three modes on the same cluster shape:

- "cold": prefix caching off on every node (``--no-prefix-caching``): each prompt is computed
  and its KV shipped in full — the baseline the issue's targets are stated against;
- "off": no Redis (routing by load); each node still reuses its own cache, and a decode node
  is sent only the blocks it lacks;
- "on": the Redis index routes by cached prefix and lets a node fetch a prefix from a peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pipeline import prefill_counters

from splitserve.client import AsyncClient, SplitserveError
from splitserve.launcher import ClusterSpec, LocalCluster

COUNTERS = ("bytes_shipped", "transfer_seconds", "prefix_blocks_fetched", "blocks_shipped")


async def one(client, prompt, gen):
    """(time to first token, prefill tokens computed), or None when the request failed."""
    t0 = time.perf_counter()
    first, usage = None, None
    try:
        async for chunk in client.stream(
            prompt_token_ids=prompt, max_tokens=gen, ignore_eos=True, temperature=0.0
        ):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            usage = chunk.usage or usage
    except SplitserveError as exc:
        print(f"request failed: {exc}", file=sys.stderr, flush=True)
        return None
    return first, usage.prompt_tokens - usage.cached_tokens


async def workload(target, warm, prompts, gen):
    async with AsyncClient(target) as client:
        await one(client, warm, 2)  # served in full: the prefix reaches a decode node too
        await asyncio.sleep(0.5)  # the index learns of the warm blocks within ~50 ms
        return await asyncio.gather(*(one(client, p, gen) for p in prompts))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--make-8b", default=None, metavar="DIR")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prefill", type=int, default=2)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--shared", type=float, default=0.9)
    ap.add_argument("--gen", type=int, default=8)
    return ap.parse_args()


def model_and_args(args) -> tuple[Path, tuple[str, ...]]:
    if args.make_8b:
        from pipeline import make_8b

        return make_8b(Path(args.make_8b)), ("--load-format", "dummy")
    from splitserve.models.tiny import ensure_tiny_model

    return Path(args.model) if args.model else ensure_tiny_model(), ()


def run_mode(args, mode, model, node_args, warm, prompts) -> dict:
    """One cluster in ``mode`` (cold: no prefix caching; off/on: without/with the index)."""
    extra = ("--no-prefix-caching",) if mode == "cold" else ()
    spec = ClusterSpec(
        model_path=str(model),
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        port=0,  # the router binds a free port itself
        device=args.device,
        node_args=(*node_args, *extra),
        prefix_index=mode == "on",
    )
    with LocalCluster(spec) as cluster:
        t0 = time.perf_counter()
        results = asyncio.run(workload(cluster.addresses.router, warm, prompts, args.gen))
        wall = time.perf_counter() - t0
        counters = prefill_counters(cluster.addresses.prefill, COUNTERS)
    failed = sum(r is None for r in results)
    results = [r for r in results if r is not None]
    ttft = sorted(r[0] for r in results)
    return dict(
        ttft_mean_s=statistics.mean(ttft),
        ttft_p99_s=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        prefill_tokens_computed=sum(r[1] for r in results),
        prompt_tokens=len(results) * args.prompt_len,
        failed=failed,
        wall_s=wall,
        gb_shipped=counters["bytes_shipped"] / 1e9,
        transfer_s=counters["transfer_seconds"],
        blocks_fetched_from_peers=counters["prefix_blocks_fetched"],
    )


def print_table(rows: dict[str, dict]) -> None:
    cold, off, on = rows["cold"], rows["off"], rows["on"]
    print(
        "\n| mode | TTFT mean s | TTFT p99 s | prefill tokens computed | of prompt tokens "
        "| KV shipped GB | blocks fetched from peers | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        computed = r["prefill_tokens_computed"]
        print(
            f"| {mode} | {r['ttft_mean_s']:.3f} | {r['ttft_p99_s']:.3f} | {computed} | "
            f"{computed / max(r['prompt_tokens'], 1):.1%} | {r['gb_shipped']:.2f} | "
            f"{r['blocks_fetched_from_peers']:.0f} | {r['failed']} |"
        )
    for name, base in (("cold", cold), ("off", off)):
        ratio = on["prefill_tokens_computed"] / max(base["prefill_tokens_computed"], 1)
        print(
            f"TTFT mean {name}/on: {base['ttft_mean_s'] / on['ttft_mean_s']:.2f}x; "
            f"prefill tokens computed on/{name}: {ratio:.1%}"
        )


def main() -> None:
    args = parse_args()
    model, node_args = model_and_args(args)
    rng = random.Random(0)
    shared = [rng.randrange(250) for _ in range(int(args.prompt_len * args.shared))]
    tail = args.prompt_len - len(shared)
    warm = [*shared, *[rng.randrange(250) for _ in range(tail)]]
    prompts = [[*shared, *[rng.randrange(250) for _ in range(tail)]] for _ in range(args.requests)]
    rows = {}
    for mode in ("cold", "off", "on"):
        rows[mode] = run_mode(args, mode, model, node_args, warm, prompts)
        print(json.dumps({"mode": mode, **rows[mode]}), flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
