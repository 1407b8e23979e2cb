"""The KV tiers in a running cluster: `splitserve up` with the host tier on and off (and, with
``--store``, a third run with a shared store added), each under the same `splitserve bench
--workload conversation --think-time` users (each waits for its answer and sends it back in the
next turn's history), one after the other in this process.

    python benchmarks/kv_tiers_cluster.py --device cuda --make-8b /tmp/llama8b --num-prefill 0 \\
        --kv-cache-mb 2048 --host-mb 32768 --conversations 256 --think-time 1 --duration 60
    python benchmarks/kv_tiers_cluster.py --device cpu --tiny --num-prefill 0 --kv-cache-mb 1 \\
        --host-mb 64 --conversations 16 --think-time 0.2 --duration 20

``--num-prefill 0 1``: a pair of runs (tier on, off) per layout. Per run: requests done, prompt
tokens and the share computed (the rest came from the pool or a tier: usage.cached_tokens), TTFT
p50/p90, goodput at TTFT <= ``--ttft-slo`` s; then per turn the computed share, the tokens new
in the turn (question and the answer fed back) and TTFT p50/p90. Full reports go to ``--out``
(one JSON file per run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from splitserve.launcher import ClusterSpec, LocalCluster


def run(
    args, model: Path, load_format: str, name: str, num_prefill: int, host_mb: int, store: bool
) -> dict:
    node_args = ["--kv-cache-mb", str(args.kv_cache_mb), "--kv-host-cache-mb", str(host_mb)]
    node_args += ["--load-format", load_format]
    if store:
        node_args += ["--kv-store", "embedded"]
    spec = ClusterSpec(
        model_path=str(model),
        device=args.device,
        num_prefill=num_prefill,
        num_decode=1,
        port=0,
        kv_store_mb=args.store_mb if store else None,
        prefix_index=not args.no_index,
        metrics_port=0,
        node_args=tuple(node_args),
        startup_timeout_s=900,
    )
    out = Path(args.out) / f"{name}.json"
    t0 = time.monotonic()
    with LocalCluster(spec) as cluster:
        started = time.monotonic() - t0
        argv = [
            sys.executable,
            *("-m", "splitserve.cli", "bench", "--target", cluster.addresses.router),
            *("--workload", "conversation", "--conversations", str(args.conversations)),
            *("--think-time", str(args.think_time), "--duration", str(args.duration)),
            *("--seed", "0", "--processes", str(args.processes), "--no-progress"),
            *("--slo", f"ttft={args.ttft_slo}", "--result-json", str(out)),
        ]
        if args.output_len:
            argv += ["--output-len", args.output_len]
        bench = subprocess.run(argv, capture_output=True, text=True, check=False)
        (Path(args.out) / f"{name}.log").write_text(bench.stdout + bench.stderr)
        if bench.returncode != 0:
            raise SystemExit(f"{name}: bench failed:\n{bench.stderr[-3000:]}")
        tiers = {
            f"{role} {node}": tier_counters(cluster.addresses.metrics[node])
            for role, nodes in (
                ("prefill", cluster.addresses.prefill),
                ("decode", cluster.addresses.decode),
            )
            for node in nodes
        }
    report = json.loads(out.read_text())
    report["started_s"] = started
    report["tier_counters"] = tiers  # each node's ("prefill ADDR", "decode ADDR") at the end
    return report


TIER_COUNTERS = ("prefix_", "host_tier_", "disk_tier_", "store_tier_")


def tier_counters(url: str) -> dict[str, float]:
    """A node's prefix and tier counters from its /metrics (what the tiers did in the run:
    blocks offloaded, skipped, loaded, evicted; hits per tier)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("splitserve_decode_").removeprefix(
                "splitserve_prefill_"
            )
            name = name.removesuffix("_total")
            if name.startswith(TIER_COUNTERS) and sample.name.endswith("_total"):
                out[name] = sample.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--make-8b", metavar="DIR", help="write the Llama-3-8B shape here (dummy)")
    src.add_argument("--tiny", action="store_true", help="the embedded random test model")
    ap.add_argument("--num-prefill", type=int, nargs="+", default=[0], help="one run pair each")
    ap.add_argument("--kv-cache-mb", type=int, required=True, help="the pool, small on purpose")
    ap.add_argument("--host-mb", type=int, default=32768, help="the host tier when on")
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--think-time", type=float, default=1.0)
    ap.add_argument("--output-len", default=None, help="each answer's length (bench's default)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--store", action="store_true", help="a third run: the tier and a store")
    ap.add_argument("--store-mb", type=int, default=8192)
    ap.add_argument(
        "--no-index",
        action="store_true",
        help="no Redis (one decode node needs no prefix index; where redis-server is missing)",
    )
    ap.add_argument("--out", default=None, help="the reports' folder (default: a new temp one)")
    args = ap.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="kv-tiers-cluster-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.make_8b:
        sys.path.insert(0, str(Path(__file__).parent))
        from pipeline import make_8b

        model, load_format = make_8b(Path(args.make_8b)), "dummy"
    else:
        from splitserve.models.tiny import write_random_checkpoint

        model = write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", with_tokenizer=True)
        load_format = "auto"

    runs = []
    for p in args.num_prefill:
        runs += [(f"P{p} on", p, args.host_mb, False), (f"P{p} off", p, 0, False)]
        if args.store:
            runs.append((f"P{p} on+store", p, args.host_mb, True))
    reports = {}
    for name, p, mb, st in runs:
        reports[name] = run(args, model, load_format, name.replace(" ", "-"), p, mb, st)
        print(f"{name}: done", flush=True)

    print(f"\nreports in {args.out}")
    print(
        f"\n| host tier | started s | done | prompt tokens | computed | TTFT p50 / p90 ms | "
        f"goodput req/s (TTFT <= {args.ttft_slo:g} s) | output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rep in reports.items():
        r = rep["results"]
        computed = r["input_tokens"] - r["cached_tokens"]
        ttft = r["ttft_s"]
        print(
            f"| {name} | {rep['started_s']:.0f} | {r['completed']:,} | {r['input_tokens']:,} | "
            f"{computed:,} ({computed / max(r['input_tokens'], 1):.0%}) | "
            f"{ttft['p50'] * 1e3:.0f} / {ttft['p90'] * 1e3:.0f} | {r['goodput']:.2f} | "
            f"{r['output_throughput']:,.0f} |"
        )
    print("\neach node's tier counters at the end of each run (those not 0):")
    for name, rep in reports.items():
        for node, counters in rep["tier_counters"].items():
            print(f"  {name} {node}: { ({k: int(v) for k, v in counters.items() if v}) }")
    print(
        "\n| host tier | turn | requests | prompt tokens | computed | new in the turn | "
        "computed / new | TTFT p50 / p90 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rep in reports.items():
        for t in rep["results"]["turns"]:
            p50, p90 = t["ttft_p50_s"], t["ttft_p90_s"]
            ttft = "-" if p50 is None else f"{p50 * 1e3:.0f} / {p90 * 1e3:.0f}"
            share = t["computed_tokens"] / max(t["prompt_tokens"], 1)
            new = t.get("new_tokens", 0)
            print(
                f"| {name} | {t['turn']} | {t['requests']} | {t['prompt_tokens']:,} | "
                f"{t['computed_tokens']:,} ({share:.0%}) | {new:,} | "
                f"{t['computed_tokens'] / max(new, 1):.2f} | {ttft} |"
            )


if __name__ == "__main__":
    main()
