"""End-to-end serving benchmark: a local cluster (separate processes) under concurrent load.

    python benchmarks/pipeline.py --device cuda --make-8b /tmp/llama8b [--requests 256]
    python benchmarks/pipeline.py --model DIR [--device cpu --requests 16 --gen 16]

``--make-8b DIR`` writes a Llama-3-8B-shaped config.json and a byte-level tokenizer into DIR;
the nodes then draw the same random bf16 weights (``--load-format dummy``), so no 16 GB file is
needed. Requests: prompts of random token ids with lengths uniform in ``--prompt-range``,
``--gen`` output tokens each (ignore_eos), all sent at once through the SDK's streaming API, or
with ``--fronts http`` as streamed ``POST /v1/completions`` to the router's OpenAI-compatible HTTP
API (``--fronts grpc http grpc http`` alternates both on one cluster, a row each). Reports output
tokens/s, time to first token (mean, p50, p99), inter-token latency (mean, p99)
and the KV bytes the prefill pool shipped, per second of wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
from shapes import llama3_8b_config

from splitserve.client import AsyncClient, SplitserveError
from splitserve.cluster_spec import router_count
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


def make_8b(path: Path, num_layers: int = 32) -> Path:
    from splitserve.models.tiny import build_byte_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    llama3_8b_config(num_layers, bos_token_id=256, eos_token_id=257).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(client: AsyncClient, prompt: list[int], gen: int, salt: str | None = None):
    """(time to first token, inter-token gaps, tokens, None) or (None, [], 0, failure code)."""
    t0 = time.perf_counter()
    stamps = []
    n = 0
    try:
        async for chunk in client.stream(
            prompt_token_ids=prompt,
            max_tokens=gen,
            ignore_eos=True,
            temperature=0.0,
            cache_salt=salt,
        ):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                n += len(chunk.token_ids)
    except SplitserveError as exc:
        return None, [], 0, exc.code.name
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - t0, itl, n, None


def prefill_counters(addresses, keys, metadata=None, creds=None) -> dict[str, float]:
    """The prefill nodes' counters ``keys``, summed over ``addresses`` (GetStats; ``metadata``:
    the cluster token's, when the nodes require it)."""
    total = dict.fromkeys(keys, 0.0)
    for address in addresses:
        channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        with channel:
            stats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(
                nodes_pb2.GetStatsRequest(), metadata=metadata
            )
        for key in keys:
            total[key] += stats.counters.get(key, 0.0)
    return total


async def one_http(session, url: str, prompt: list[int], gen: int, salt: str | None = None):
    """As ``one``, through the HTTP API (server-sent events)."""
    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "cache_salt": salt}  # fmt: skip
    import aiohttp

    t0 = time.perf_counter()
    stamps = []
    n = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return None, [], 0, f"HTTP {resp.status}"
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return None, [], 0, f"HTTP error {event['error']['code']}"
                ids = event["choices"][0]["token_ids"] if event["choices"] else []
                if ids:
                    stamps.append(time.perf_counter())
                    n += len(ids)
    except aiohttp.ClientError as exc:
        return None, [], 0, type(exc).__name__
    if not stamps:
        return None, [], 0, "no tokens"
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - t0, itl, n, None


async def load(target: str, prompts: list[list[int]], gen: int, creds=None, salt=None):
    """Every prompt at once on one client: (per-request results, wall s). The client is
    connected first, as a serving client's pool is: as many 1-token requests at once as there are
    prompts (an HTTP/1.1 client needs a connection per concurrent request), not timed."""
    warm = [[1, 2, 3]] * len(prompts)
    if target.startswith("http://"):
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)  # every request at once, as over gRPC
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(one_http(session, target, p, 1, "warm") for p in warm))
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(one_http(session, target, p, gen, salt) for p in prompts)
            )
            return results, time.perf_counter() - t0
    async with AsyncClient(target, credentials=creds) as client:
        await asyncio.gather(*(one(client, p, 1, "warm") for p in warm))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, p, gen, salt) for p in prompts))
        return results, time.perf_counter() - t0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--make-8b", default=None, metavar="DIR")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prefill", type=int, default=1)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--num-routers", type=router_count, default="auto",
                    help="as `splitserve up --num-routers` (default: auto)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 1024])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--redis-url", default=None, help="default: the launcher starts one")
    ap.add_argument(
        "--node-hostnames",
        action="store_true",
        help="each node under its own host name (root): one container per node, emulated",
    )
    ap.add_argument(
        "--auth",
        action="store_true",
        help="a cluster token on every internal call (what `splitserve up` does by default)",
    )
    ap.add_argument(
        "--tls",
        default=None,
        metavar="DIR",
        help="mutual TLS everywhere: DIR holds ca.pem, node.pem and node.key (one identity for "
        "every component and the client; its names must cover 127.0.0.1)",
    )
    ap.add_argument(
        "--target",
        default=None,
        help="measure a running deployment's router (host:port) instead of starting a cluster",
    )
    ap.add_argument(
        "--prefill",
        default="",
        help="with --target: its prefill nodes (host:port,...), to count the KV bytes shipped",
    )
    ap.add_argument(
        "--fronts",
        nargs="+",
        choices=("grpc", "http"),
        default=["grpc"],
        help="the router's API each run goes through, in order (one cluster, a row per run)",
    )
    ap.add_argument(
        "--otlp-endpoint",
        default=None,
        help="every component sends traces here (`splitserve up --otlp-endpoint`)",
    )
    ap.add_argument(
        "--otlp-sample-ratio", type=float, default=None, help="the share of requests traced"
    )
    ap.add_argument(
        "--http-target",
        default=None,
        help="with --target: the router's HTTP API (http://host:port) for --fronts http",
    )
    return ap.parse_args()


def cluster_spec(args) -> ClusterSpec:
    if args.make_8b:
        model = make_8b(Path(args.make_8b))
        node_args: tuple[str, ...] = ("--load-format", "dummy")
    else:
        from splitserve.models.tiny import ensure_tiny_model

        model = Path(args.model) if args.model else ensure_tiny_model()
        node_args = ()
    return ClusterSpec(
        model_path=str(model),
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        num_routers=args.num_routers,
        port=0,  # the router binds a free port itself
        device=args.device,
        node_args=node_args,
        redis_url=args.redis_url,
        node_hostnames=args.node_hostnames,
        auth_token_file="auto" if args.auth else None,
        http_port=0 if "http" in args.fronts else None,
        otlp_endpoint=args.otlp_endpoint,
        otlp_sample_ratio=args.otlp_sample_ratio,
        **tls_fields(args.tls),
    )


def tls_fields(folder: str | None) -> dict:
    if folder is None:
        return {}
    d = Path(folder)
    return dict(tls_cert=str(d / "node.pem"), tls_key=str(d / "node.key"), tls_ca=str(d / "ca.pem"))


def credentials(folder: str | None):
    """The client's (and this script's GetStats calls') mTLS credentials, or None."""
    if folder is None:
        return None
    d = Path(folder)
    read = [(d / n).read_bytes() for n in ("ca.pem", "node.key", "node.pem")]
    return grpc.ssl_channel_credentials(*read)


COUNTED = ("bytes_shipped", "transfers_ipc", "transfers_dist", "transfers_tcp", "transfers_failed")


def summary(args, prompts, results, wall: float, counted: dict[str, float]) -> dict:
    """The figures of one run: ``results`` of ``one`` per prompt, ``counted``: the prefill
    pool's counters over the run (KV bytes shipped, transfers per path)."""
    shipped = counted["bytes_shipped"]
    failed = Counter(r[3] for r in results if r[3] is not None)
    results = [r for r in results if r[3] is None]
    paths = {
        k.removeprefix("transfers_"): int(v) for k, v in counted.items() if k.startswith("transf")
    }
    ttft = [r[0] for r in results]
    itl = [x for r in results for x in r[1]]
    out_tokens = sum(r[2] for r in results)
    return dict(
        requests=args.requests,
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=out_tokens,
        wall_s=wall,
        out_tok_s=out_tokens / wall,
        ttft_mean_s=statistics.mean(ttft),
        ttft_p50_s=pct(ttft, 0.5),
        ttft_p99_s=pct(ttft, 0.99),
        itl_mean_ms=statistics.mean(itl) * 1e3 if itl else None,
        itl_p99_ms=pct(itl, 0.99) * 1e3 if itl else None,
        kv_bytes_shipped=shipped,
        kv_gbps_wall=shipped / wall / 1e9,
        kv_transfers=" ".join(f"{k}:{v}" for k, v in paths.items() if v) or "grpc bytes only",
        failed=" ".join(f"{k}:{v}" for k, v in sorted(failed.items())) or "0",
        # Python processes that can saturate: the benchmark's client and the router.
        client_cpu_s=counted.get("client_cpu_s", 0.0),
        router_cpu_s=counted.get("router_cpu_s", 0.0),
    )


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc; 0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    router: str, prefill, prompts, gen: int, run: int = 0, metadata=None, creds=None, pid=None
):
    """Warm up, then send every prompt at once: (per-request results, wall s, the prefill pool's
    counters over the run). Run ``run`` > 0 salts its prompts' cache (``run-N``): the same work
    as the first run, none of it found cached."""
    salt = f"run-{run}" if run else None
    asyncio.run(load(router, prompts[:2], 4, creds, salt))
    before = prefill_counters(prefill, COUNTED, metadata, creds)
    cpu = (time.process_time(), cpu_seconds(pid))
    results, wall = asyncio.run(load(router, prompts, gen, creds, salt))
    after = prefill_counters(prefill, COUNTED, metadata, creds)
    counted = {k: after[k] - before[k] for k in COUNTED}
    counted["client_cpu_s"] = time.process_time() - cpu[0]
    counted["router_cpu_s"] = cpu_seconds(pid) - cpu[1]
    return results, wall, counted


def main() -> None:
    args = parse_args()
    lo, hi = args.prompt_range

    rng = random.Random(0)
    prompts = [
        [rng.randrange(250) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)
    ]
    rows = []
    if args.target and "http" in args.fronts and not args.http_target:
        sys.exit("--fronts http with --target needs --http-target http://HOST:PORT")
    if args.target:
        prefill = [a.strip() for a in args.prefill.split(",") if a.strip()]
        targets = {"grpc": args.target, "http": args.http_target}
        for run, front in enumerate(args.fronts):
            results, wall, shipped = measure(targets[front], prefill, prompts, args.gen, run)
            rows.append({"front": front, **summary(args, prompts, results, wall, shipped)})
    else:
        with LocalCluster(cluster_spec(args)) as cluster:
            addr = cluster.addresses
            targets = {"grpc": addr.router, "http": f"http://{addr.http}"}
            for run, front in enumerate(args.fronts):
                results, wall, shipped = measure(
                    targets[front],
                    addr.prefill,
                    prompts,
                    args.gen,
                    run,
                    cluster.call_metadata,
                    credentials(args.tls),
                    cluster.pids().get("router-0"),
                )
                rows.append({"front": front, **summary(args, prompts, results, wall, shipped)})
    for row in rows:
        print(json.dumps(row))
    keys = list(rows[0])
    print("\n| figure | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " |")
    print("|---|" + "---|" * len(rows))
    for key in keys:
        cells = [f"{r[key]:.4g}" if isinstance(r[key], float) else str(r[key]) for r in rows]
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
