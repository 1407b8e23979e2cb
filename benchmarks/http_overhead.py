"""What the router's HTTP API costs beside its gRPC API: 1-token completions through each.

    python benchmarks/http_overhead.py [--requests 300] [--concurrency 16] [--model DIR]

Starts a local cluster (1 prefill + 1 decode node, the embedded tiny model on the CPU unless
``--model``/``--device``) with the HTTP API on, then for each front: ``--requests`` requests one
after another (latency p50/p99), and ``--requests`` with ``--concurrency`` in flight
(requests/s). Fronts: gRPC ``Complete`` (unary), gRPC ``Generate`` through the SDK's stream, and
``POST /v1/completions`` (JSON, not streamed). Every request is the same short token-id prompt
and 1 greedy token, so the nodes' work is the same and small: the differences are the fronts'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import grpc

from splitserve.client import AsyncClient
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Fronts:
    def __init__(self, router: str, http: str) -> None:
        self.router, self.http = router, http

    async def __aenter__(self) -> Fronts:
        self.channel = grpc.aio.insecure_channel(self.router)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.sdk = AsyncClient(self.router)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self.sdk.close()
        await self.channel.close()

    async def grpc_complete(self) -> None:
        sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
        request = router_pb2.GenerateRequest(token_ids={"ids": PROMPT}, sampling=sampling)
        reply = await self.stub.Complete(request, timeout=60)
        assert len(reply.token_ids) == 1

    async def grpc_stream(self) -> None:
        result = await self.sdk.generate(prompt_token_ids=PROMPT, max_tokens=1, temperature=0.0)
        assert len(result.token_ids) == 1

    async def http_completion(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
        async with self.session.post(self.http + "/v1/completions", json=body) as resp:
            reply = json.loads(await resp.read())
        assert resp.status == 200 and reply["usage"]["completion_tokens"] == 1, reply


async def run(fronts: Fronts, requests: int, concurrency: int) -> list[dict]:
    rows = []
    for name in ("grpc_complete", "grpc_stream", "http_completion"):
        call = getattr(fronts, name)
        for _ in range(20):  # warm-up: connections, caches
            await call()
        latencies = []
        for _ in range(requests):
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)
        queue = iter(range(requests))

        async def worker(call=call, queue=queue) -> None:
            for _ in queue:
                await call()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rps = requests / (time.perf_counter() - t0)
        rows.append(
            {
                "front": name,
                "p50_ms": pct(latencies, 0.5) * 1e3,
                "p99_ms": pct(latencies, 0.99) * 1e3,
                "rps_serial": requests / sum(latencies),
                f"rps_c{concurrency}": rps,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded tiny model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    if args.model is None:
        from splitserve.models.tiny import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    spec = ClusterSpec(
        model_path=args.model,
        port=0,  # the router binds a free port itself
        device=args.device,
        http_port=0,
        auth_token_file=None,
    )
    with LocalCluster(spec) as cluster:
        a = cluster.addresses
        rows = asyncio.run(_measure(a.router, f"http://{a.http}", args))
    base = rows[0]
    print(json.dumps(rows))
    keys = list(rows[0])[1:]
    print("\n| front | " + " | ".join(keys) + " | added p50 ms | added p99 ms |")
    print("|---|" + "---|" * (len(keys) + 2))
    for row in rows:
        cells = [f"{row[k]:.4g}" for k in keys]
        added = [row["p50_ms"] - base["p50_ms"], row["p99_ms"] - base["p99_ms"]]
        tail = f" | {added[0]:+.2f} | {added[1]:+.2f} |"
        print(f"| {row['front']} | " + " | ".join(cells) + tail)


async def _measure(router: str, http: str, args) -> list[dict]:
    async with Fronts(router, http) as fronts:
        return await run(fronts, args.requests, args.concurrency)


if __name__ == "__main__":
    main()
