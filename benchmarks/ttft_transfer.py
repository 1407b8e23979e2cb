"""Time to first token of long prompts with each KV transfer path of the services.

    python benchmarks/ttft_transfer.py --device cuda --make-8b /tmp/llama8b [--prompt-len 4096]
    python benchmarks/ttft_transfer.py --paths none dist --prompt-len 512     # CPU, tiny model
    python benchmarks/ttft_transfer.py --device cuda --make-8b /tmp/llama8b --paths tcp tcp:stream

Per path (``--kv-transfer`` of both nodes: ``none`` = gRPC bytes, ``ipc``, ``dist``, ``tcp``; a
``:stream`` suffix: the prefill node ships the KV layer by layer while it computes it,
``--kv-stream-min-tokens 1``; without it the whole prompt's KV leaves after the prefill,
``--kv-stream-min-tokens 0``), a fresh local cluster of one prefill and one decode node;
``--requests`` prompts of unique random tokens (nothing cached anywhere) are sent one at a time,
``--gen`` output tokens each, after one warm-up request. Reported: mean and median time to first
token as the client sees it (prefill, shipping the prompt's KV into the decode node, the first
token back), the decode node's transfer counters (which path the blocks took) and how many
transfers the prefill node streamed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import grpc

from splitserve.client import AsyncClient
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


async def ttft(client: AsyncClient, prompt: list[int], gen: int) -> float:
    t0 = time.perf_counter()
    first = None
    async for chunk in client.stream(
        prompt_token_ids=prompt, max_tokens=gen, ignore_eos=True, temperature=0.0
    ):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    return first


async def workload(target: str, prompts: list[list[int]], gen: int) -> list[float]:
    async with AsyncClient(target) as client:
        await ttft(client, prompts[0], gen)  # warm-up (first transfer sets up the path)
        return [await ttft(client, p, gen) for p in prompts[1:]]


def decode_counters(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        stats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(nodes_pb2.GetStatsRequest())
    return dict(stats.counters)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--make-8b", default=None, metavar="DIR")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--paths", nargs="+", default=None, help="default: none ipc on CUDA")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=4)
    args = ap.parse_args()
    if args.make_8b:
        from pipeline import make_8b

        model, node_args = make_8b(Path(args.make_8b)), ("--load-format", "dummy")
    else:
        from splitserve.models.tiny import ensure_tiny_model

        model, node_args = Path(args.model) if args.model else ensure_tiny_model(), ()
    paths = args.paths or (["none", "ipc"] if args.device.startswith("cuda") else ["none", "dist"])
    rng = random.Random(0)
    prompts = [
        [rng.randrange(250) for _ in range(args.prompt_len)] for _ in range(args.requests + 1)
    ]
    rows = {}
    for name in paths:
        path, _, mode = name.partition(":")
        stream = ("--kv-stream-min-tokens", "1" if mode == "stream" else "0")
        for attempt in (1, 2):  # (a node may take the router's port, chosen before they start)
            spec = ClusterSpec(
                model_path=str(model),
                num_prefill=1,
                num_decode=1,
                port=0,  # the router binds a free port itself
                device=args.device,
                node_args=(*node_args, "--kv-transfer", path, *stream),
                prefix_index=False,
            )
            try:
                with LocalCluster(spec) as cluster:
                    times = asyncio.run(workload(cluster.addresses.router, prompts, args.gen))
                    counters = decode_counters(cluster.addresses.decode[0])
                    prefill = decode_counters(cluster.addresses.prefill[0])
                break
            except RuntimeError as exc:
                if attempt == 2 or "while starting" not in str(exc):
                    raise
        streamed = prefill.get("transfers_streamed", 0)
        rows[name] = dict(
            ttft_mean_s=statistics.mean(times),
            ttft_median_s=statistics.median(times),
            transfers=counters.get("transfers", 0),
            via_layer=sum(
                v
                for k, v in counters.items()
                if k in ("transfers_ipc", "transfers_dist", "transfers_tcp")
            ),
            streamed=streamed,
            gb_received=counters.get("bytes_received", 0) / 1e9,
        )
        print(json.dumps({"path": name, **rows[name]}), flush=True)
    print(
        f"\n{args.prompt_len}-token prompts, {args.requests} requests one at a time, "
        f"device {args.device}\n"
    )
    print(
        "| --kv-transfer | TTFT mean s | TTFT median s | transfers (via the layer, streamed) | GB |"
    )
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['ttft_mean_s']:.3f} | {r['ttft_median_s']:.3f} | "
            f"{r['transfers']:.0f} ({r['via_layer']:.0f}, {r['streamed']:.0f}) | "
            f"{r['gb_received']:.2f} |"
        )


if __name__ == "__main__":
    main()
