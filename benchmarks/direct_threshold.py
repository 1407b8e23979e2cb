"""Where the direct route pays: one 1 prefill + 1 decode cluster, a router per
``--direct-prefill-tokens`` value in turn, the same workload through each (``splitserve bench``).

    python benchmarks/direct_threshold.py --device cuda --make-8b /tmp/llama8b \\
        --thresholds 0 64 128 256 512 --input-len uniform:16:512 --request-rate 24
    python benchmarks/direct_threshold.py --thresholds 0 128 --num-requests 24 --request-rate 4 \\
        --input-len uniform:16:256 --output-len 16   # CPU, the embedded model

The nodes stay up for every threshold (so each router meets the same warm nodes); each run sends
the workload under its own cache salt, so no run finds another's prompts cached. Per threshold:
the share of requests the router sent straight to the decode node (its
``splitserve_router_routes_total``), output tok/s, TTFT and TPOT p50 / p99, and goodput and SLO
attainment under ``--slo``. A threshold of T sends a request direct when at most T of its prompt
tokens are not cached on the decode node (0: never); "best" is the row with the most goodput, then
the lowest TTFT p99.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from local_cluster import add_model_args, cluster_spec

from splitserve.launcher import LocalCluster


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--thresholds", type=int, nargs="+", default=[0, 64, 128, 256, 512])
    ap.add_argument("--input-len", default="uniform:16:512")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--request-rate", default="24")
    ap.add_argument("--num-requests", type=int, default=360)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--slo", default="ttft=2,tpot=0.05")
    ap.add_argument("--out", default=None, help="folder for each run's JSON (default: a temp one)")
    return ap.parse_args()


def scrape_routes(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    routes = {}
    for line in text.splitlines():
        if line.startswith("splitserve_router_routes_total{"):
            labels, _, value = line.rpartition(" ")
            routes[labels.split('route="')[1].split('"')[0]] = float(value)
    return routes


def one_threshold(args, cluster, threshold: int, out: Path) -> dict:
    port_file = out / f"router-{threshold}.port"
    metrics_file = out / f"router-{threshold}.metrics-port"
    for stale in (port_file, metrics_file):  # a run before into the same --out left them
        stale.unlink(missing_ok=True)
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "router",
            "--model",
            cluster.spec.model_path,
            "--redis-url",
            cluster.addresses.redis_url,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--metrics-port",
            "0",
            "--metrics-port-file",
            str(metrics_file),
            "--direct-prefill-tokens",
            str(threshold),
        ],
        stdout=(out / f"router-{threshold}.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text().strip() for f in (port_file, metrics_file)):
            if router.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"router with threshold {threshold} did not start: see {out}")
            time.sleep(0.2)
        target = f"127.0.0.1:{port_file.read_text().strip()}"
        metrics_port = int(metrics_file.read_text())
        time.sleep(3)  # it discovers both nodes through Redis
        result = out / f"threshold-{threshold}.json"
        bench = [
            sys.executable,
            "-m",
            "splitserve.cli",
            "bench",
            "--target",
            target,
            "--input-len",
            args.input_len,
            "--output-len",
            args.output_len,
            "--request-rate",
            args.request_rate,
            "--num-requests",
            str(args.num_requests),
            "--warmup",
            str(args.warmup),
            "--slo",
            args.slo,
            "--seed",
            "7",
            "--cache-salt",
            f"threshold-{threshold}",
            "--no-progress",
            "--result-json",
            str(result),
        ]
        log = out / f"bench-{threshold}.log"
        with log.open("w") as f:
            subprocess.run(bench, stdout=f, stderr=subprocess.STDOUT, check=True)
        routes = scrape_routes(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        router.terminate()
        router.wait(30)
    r = json.loads(result.read_text())["results"]
    sent = sum(routes.values()) or 1
    return {
        "threshold": threshold,
        "direct_share": routes.get("direct", 0.0) / sent,
        "output_tok_s": r["output_throughput"],
        "ttft_p50_ms": 1e3 * r["ttft_s"]["p50"],
        "ttft_p99_ms": 1e3 * r["ttft_s"]["p99"],
        "tpot_p50_ms": 1e3 * r["tpot_s"]["p50"],
        "tpot_p99_ms": 1e3 * r["tpot_s"]["p99"],
        "goodput": r["goodput"],
        "slo_attainment": r["slo_attainment"],
        "failed": r["failed"],
    }


def main() -> None:
    args = parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="direct-threshold-"))
    out.mkdir(parents=True, exist_ok=True)
    spec = cluster_spec(args, num_prefill=1)
    rows = []
    with LocalCluster(spec) as cluster:
        for threshold in args.thresholds:
            row = one_threshold(args, cluster, threshold, out)
            print(json.dumps(row), flush=True)
            rows.append(row)
    # Goodput first (to a tenth of a request/s: closer is run-to-run noise), then the lower TTFT.
    best = max(rows, key=lambda r: (round(r["goodput"] or 0.0, 1), -r["ttft_p99_ms"]))
    print(
        f"\nworkload: --input-len {args.input_len} --output-len {args.output_len} "
        f"--request-rate {args.request_rate} --num-requests {args.num_requests}; runs in {out}"
    )
    print(
        "| --direct-prefill-tokens | sent direct | output tok/s | TTFT p50 / p99 (ms) | "
        "TPOT p50 / p99 (ms) | goodput (req/s) | SLO attainment | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        good = "-" if r["goodput"] is None else f"{r['goodput']:.2f}"
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.0f}%"
        print(
            f"| {r['threshold']} | {100 * r['direct_share']:.0f}% | {r['output_tok_s']:,.0f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {good} | {att} | {r['failed']} |"
        )
    print(f"\nbest: --direct-prefill-tokens {best['threshold']}")


if __name__ == "__main__":
    main()
