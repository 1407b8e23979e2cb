"""Overload is a queue, not a collapse: one cluster, a rate sweep past its knee, and what each rate
cost the pools (``splitserve bench`` per rate, a fresh router per rate).

    python benchmarks/overload.py --device cuda --make-8b /tmp/llama8l --layers 8 \\
        --num-prefill 4 --gpu-memory-utilization 0.12 --rates 32 64 128
    python benchmarks/overload.py --rates 4 16 64 --duration 10 --workload "--workload \
        shared-prefix --num-prefixes 32 --prefix-len 256 --question-len 32 --output-len 16"  # CPU

Per rate: output tok/s, requests completed / refused (by reason, and how fast the refusals came)
/ failed, TTFT p50 / p99, SLO attainment, the prefill pool's computed prompt tokens against the
prompts of the requests served (the prefill nodes' own counters, ``prompt_tokens -
cached_tokens``), prefill attempts retried (the router's), transfers that failed or waited on the
decode node for blocks. Each rate's workload goes under its own cache salt, so no run finds
another's prompts cached. ``--index on`` routes with the Redis prefix index (the cluster always
runs one; ``off`` gives the router static node lists and no index). JSON of every run in
``--out``; ``--plot JSON`` draws the sweep from a finished run's ``sweep.json`` (no cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from splitserve.cluster_spec import ClusterSpec, free_port
from splitserve.launcher import LocalCluster
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

# The multi-tenant workload of the overload issue: 512 system prompts of 2,048 tokens, 8
# questions each of 128, 64 tokens out.
WORKLOAD = [
    "--workload", "shared-prefix", "--num-prefixes", "512", "--prefix-len", "2048",
    "--questions-per-prefix", "8", "--question-len", "128", "--output-len", "64",
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    ap.add_argument("--make-8b", default=None, metavar="DIR", help="Llama-3-8B's shape (dummy)")
    ap.add_argument("--layers", type=int, default=32, help="with --make-8b: decoder layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prefill", type=int, default=2)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--node-arg", action="append", default=[], help="a flag for every node")
    ap.add_argument("--router-arg", action="append", default=[], help="a flag for each router")
    ap.add_argument("--rates", type=float, nargs="+", default=[32, 64, 128])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--timeout", type=float, default=30.0, help="each request's deadline (s)")
    ap.add_argument("--slo", default="ttft=2,tpot=0.05")
    ap.add_argument("--index", choices=("off", "on"), nargs="+", default=["off"])
    ap.add_argument("--workload", default=None,
                    help="splitserve bench's workload flags, one string (default: the "
                    "shared-prefix workload of the overload issue)")  # fmt: skip
    ap.add_argument("--out", default=None, help="folder for every run's files")
    ap.add_argument("--before", default=None, metavar="PYTHONPATH",
                    help="also run each rate through a router imported from here (an older "
                    "tree installed with pip --target), its rows labelled 'before'")  # fmt: skip
    ap.add_argument("--before-rates", type=float, nargs="+", default=None,
                    help="the rates of the 'before' rows (default: --rates)")  # fmt: skip
    ap.add_argument("--plot", default=None, metavar="JSON", help="plot a sweep.json and exit")
    return ap.parse_args()


def make_model(args) -> tuple[str, tuple[str, ...]]:
    if args.make_8b:
        from pipeline import make_8b

        return str(make_8b(Path(args.make_8b), args.layers)), ("--load-format", "dummy")
    if args.model:
        return args.model, ()
    from splitserve.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model()), ()


def counters(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return dict(stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10).counters)


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("splitserve_router_") and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def start_router(cluster, model: str, index: str, out: Path, tag: str, extra: list[str], env=None):
    addr = cluster.addresses
    port_file = out / f"router-{tag}.port"
    port_file.unlink(missing_ok=True)  # a run before into the same --out left one
    metrics_port = free_port()
    nodes = ["--redis-url", addr.redis_url] if index == "on" else []
    nodes += ["--prefill", ",".join(addr.prefill)] if addr.prefill else []
    cmd = [
        sys.executable, "-m", "splitserve.cli", "router", "--model", model,
        "--decode", ",".join(addr.decode), *nodes, "--port", "0", "--port-file", str(port_file),
        "--metrics-port", str(metrics_port), "--max-requests-per-client", "100000", *extra,
    ]  # fmt: skip
    log = (out / f"router-{tag}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"router {tag} did not start: see {out}")
        time.sleep(0.2)
    time.sleep(2.0)  # health checks and the nodes' GetStats (capacities) answered
    return proc, f"127.0.0.1:{port_file.read_text().strip()}", f"http://127.0.0.1:{metrics_port}"


def one_rate(args, cluster, model: str, rate: float, index: str, out: Path, env=None) -> dict:
    label = index if env is None else f"{index}, before"
    tag = f"{index}-r{rate:g}" if env is None else f"{index}-before-r{rate:g}"
    extra = args.router_arg if env is None else []  # an older router may lack newer options
    router, target, metrics = start_router(cluster, model, index, out, tag, extra, env)
    prefill, decode = cluster.addresses.prefill, cluster.addresses.decode
    try:
        before = {a: counters(a) for a in (*prefill, *decode)}
        result = out / f"bench-{tag}.json"
        workload = shlex.split(args.workload) if args.workload else WORKLOAD
        bench = [
            sys.executable, "-m", "splitserve.cli", "bench", "--target", target,
            *workload, "--request-rate", f"{rate:g}",
            "--duration", f"{args.duration:g}", "--timeout", f"{args.timeout:g}",
            "--slo", args.slo, "--seed", "1", "--cache-salt", tag, "--no-progress",
            "--result-json", str(result), "--metrics-url", f"{metrics}/metrics",
        ]  # fmt: skip
        with (out / f"bench-{tag}.log").open("w") as log:
            subprocess.run(bench, stdout=log, stderr=subprocess.STDOUT)  # 1: none completed
        router_figures = scrape(f"{metrics}/metrics")
        after = {a: counters(a) for a in (*prefill, *decode)}
    finally:
        router.terminate()
        router.wait(30)

    def delta(addresses, name):
        return sum(after[a].get(name, 0.0) - before[a].get(name, 0.0) for a in addresses)

    r = json.loads(result.read_text())["results"]
    computed = delta(prefill, "prompt_tokens") - delta(prefill, "cached_tokens")
    refused_by = {
        k.split('reason="')[1].rstrip('"}'): v
        for k, v in router_figures.items()
        if k.startswith("splitserve_router_refused_total{") and v
    }
    lat = r["refusal_latency_s"]
    n_ref = router_figures.get("splitserve_router_refusal_seconds_count", 0.0)
    ref_sum = router_figures.get("splitserve_router_refusal_seconds_sum", 0.0)
    fast = router_figures.get('splitserve_router_refusal_seconds_bucket{le="0.1"}', 0.0)
    return {
        "index": label,
        "rate": rate,
        "output_tok_s": r["output_throughput"],
        "completed": r["completed"],
        "refused": r["refused"],
        "refused_by_reason": refused_by,
        "refusal_p99_ms": None if lat["p99"] is None else 1e3 * lat["p99"],
        "refusal_max_ms": None if lat["max"] is None else 1e3 * lat["max"],
        "router_refusal_mean_ms": 1e3 * ref_sum / n_ref if n_ref else None,
        "router_refused_within_100ms": fast / n_ref if n_ref else None,
        "failed": r["failed"],
        "failures": r["failures"],
        "ttft_p50_ms": 1e3 * (r["ttft_s"]["p50"] or 0),
        "ttft_p99_ms": 1e3 * (r["ttft_s"]["p99"] or 0),
        "slo_attainment": r["slo_attainment"],
        "served_prompt_tokens": r["input_tokens"],
        "served_cached_tokens": r["cached_tokens"],
        "computed_prompt_tokens": computed,
        "prefill_retries": router_figures.get("splitserve_router_prefill_retries_total", 0.0),
        "prefill_transfers_failed": delta(prefill, "transfers_failed"),
        "decode_transfers_waited": delta(decode, "transfers_waited_for_blocks"),
        "decode_transfers_failed": delta(decode, "transfers_failed"),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| index | rate (req/s) | output tok/s | done | refused (client p99 / max ms) | failed | "
        "TTFT p50 / p99 (ms) | SLO att. | computed / served prompt tokens | computed / uncached "
        "served | prefill retries | transfers failed P / waited D |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        uncached = max(r["served_prompt_tokens"] - r["served_cached_tokens"], 1)
        ref = f"{r['refused']:.0f}"
        if r["refused"]:
            ref += f" ({r['refusal_p99_ms']:.0f} / {r['refusal_max_ms']:.0f}"
            if r.get("router_refused_within_100ms") is not None:
                ref += f"; router: {100 * r['router_refused_within_100ms']:.0f}% <= 100 ms"
            ref += ")"
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.0f}%"
        lines.append(
            f"| {r['index']} | {r['rate']:g} | {r['output_tok_s']:,.0f} | {r['completed']} | "
            f"{ref} | {r['failed']} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {att} | "
            f"{r['computed_prompt_tokens'] / max(r['served_prompt_tokens'], 1):.3f} | "
            f"{r['computed_prompt_tokens'] / uncached:.3f} | {r['prefill_retries']:.0f} | "
            f"{r['prefill_transfers_failed']:.0f} / {r['decode_transfers_waited']:.0f} |"
        )
    return "\n".join(lines)


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(Path(path).read_text())["rows"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for index in sorted({r["index"] for r in rows}):
        rs = [r for r in rows if r["index"] == index]
        rates = [r["rate"] for r in rs]
        sent = [max(r["completed"] + r["refused"] + r["failed"], 1) for r in rs]

        def share(key, rs=rs, sent=sent):
            return [r[key] / n for r, n in zip(rs, sent, strict=True)]

        ax.plot(rates, [r["output_tok_s"] for r in rs], "o-", label=index)
        color = bx.plot(rates, share("completed"), "o-", label=f"served, {index}")[0].get_color()
        bx.plot(rates, share("refused"), "x--", color=color, label=f"refused, {index}")
        bx.plot(rates, share("failed"), "s:", color=color, label=f"failed, {index}")
    ax.set(xlabel="offered load (req/s)", ylabel="output tok/s", title="throughput vs load")
    bx.set(xlabel="offered load (req/s)", ylabel="share of the requests sent",
           title="served, refused, failed")  # fmt: skip
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    png = Path(path).with_suffix(".png")
    fig.savefig(png, dpi=110)
    print(png)


def main() -> None:
    args = parse_args()
    if args.plot:
        plot(args.plot)
        return
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="overload-"))
    out.mkdir(parents=True, exist_ok=True)
    model, node_args = make_model(args)
    spec = ClusterSpec(
        model_path=model,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        port=free_port(),
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        node_args=(*node_args, *args.node_arg),
    )
    runs = [(index, rate, None) for index in args.index for rate in args.rates]
    if args.before:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (args.before, os.environ.get("PYTHONPATH")) if p
        )}  # fmt: skip
        check = [sys.executable, "-c", "import splitserve; print(splitserve.__file__)"]
        where = subprocess.run(check, env=env, capture_output=True, text=True, check=True)
        if not where.stdout.startswith(str(Path(args.before).resolve())):
            sys.exit(f"--before {args.before}: splitserve is imported from {where.stdout}")
        runs += [(args.index[0], rate, env) for rate in args.before_rates or args.rates]
    rows = []
    with LocalCluster(spec) as cluster:
        for index, rate, env in runs:
            row = one_rate(args, cluster, model, rate, index, out, env)
            print(json.dumps(row), flush=True)
            rows.append(row)
            (out / "sweep.json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    print(f"\nruns in {out}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
