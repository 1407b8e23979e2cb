"""The router's CPU per relayed token: what caps a serving layout once its engine is fast.

    python benchmarks/router_cpu.py                        # CPU, the embedded model
    python benchmarks/router_cpu.py --device cuda --make-8b /tmp/llama8b --node-hostnames

One cluster (``--num-prefill`` prefill nodes, default 0: the colocated layout, and one decode
node); ``--runs`` times the same ``splitserve bench`` workload (every request at once, each run
under its own cache salt), and around each run the router process's CPU seconds (user + system,
every thread, from /proc). Per run: output tok/s, the router's CPU seconds, and its CPU per
output token (the requests' own admission work included). A router that relays N tok/s at C
microseconds each needs N x C / 1e6 cores: past one, Python's one event loop is the limit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from local_cluster import add_model_args, cluster_spec
from pipeline import cpu_seconds

from splitserve.launcher import LocalCluster


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--num-prefill", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", default="uniform:32:64")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    out = Path(tempfile.mkdtemp(prefix="router-cpu-"))
    spec = cluster_spec(args, args.num_prefill)
    rows = []
    with LocalCluster(spec) as cluster:
        router = next(pid for name, pid in cluster.pids().items() if name.startswith("router"))
        for run in range(args.runs):
            result = out / f"run-{run}.json"
            bench = [
                sys.executable, "-m", "splitserve.cli", "bench",
                "--target", cluster.addresses.router,
                "--num-requests", str(args.num_requests), "--request-rate", "inf",
                "--input-len", args.input_len, "--output-len", str(args.output_len),
                "--warmup", "0", "--no-progress", "--cache-salt", f"router-cpu-{run}",
                "--result-json", str(result),
            ]  # fmt: skip
            before = cpu_seconds(router)
            with (out / f"run-{run}.log").open("w") as log:
                subprocess.run(bench, stdout=log, stderr=subprocess.STDOUT, check=True)
            used = cpu_seconds(router) - before
            r = json.loads(result.read_text())["results"]
            row = {
                "run": run,
                "output_tok_s": r["output_throughput"],
                "output_tokens": r["output_tokens"],
                "router_cpu_s": used,
                "router_us_per_token": 1e6 * used / max(r["output_tokens"], 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(
        f"\nworkload: {args.num_requests} requests at once, --input-len {args.input_len} "
        f"--output-len {args.output_len}, --num-prefill {args.num_prefill}; runs in {out}"
    )
    print("| run | output tok/s | output tokens | router CPU s | router CPU us / token |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['output_tok_s']:,.0f} | {r['output_tokens']} | "
            f"{r['router_cpu_s']:.2f} | {r['router_us_per_token']:.0f} |"
        )


if __name__ == "__main__":
    main()
