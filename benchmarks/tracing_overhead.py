"""What tracing costs: the pipeline benchmark on a fresh local cluster with tracing off, then on
(every component sending OTLP/HTTP to a receiver this script runs, at ``--ratio`` of requests),
alternating ``--rounds`` times; a row per run and the throughput ratio on/off.

    python benchmarks/tracing_overhead.py --ratio 0.01 -- --requests 64 --gen 32   # CPU, tiny
    python benchmarks/tracing_overhead.py --ratio 0.01 -- --device cuda --make-8b /tmp/llama8b

Arguments after ``--`` go to benchmarks/pipeline.py as they are. The receiver decodes each
export (protobuf ExportTraceServiceRequest) and counts its spans, so the table also says how
much was traced. Needs the ``otel`` extra (``pip install 'splitserve[otel]'``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the tests' OTLP receiver (needs the otel extra)

from support.otlp import serve_receiver  # noqa: E402


def run_pipeline(args: list[str]) -> dict:
    """One pipeline.py run (a fresh cluster): its first JSON row."""
    out = subprocess.run(
        [sys.executable, str(HERE / "pipeline.py"), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not rows:
        sys.exit(
            f"pipeline.py failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
        )
    return json.loads(rows[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratio", type=float, default=0.01, help="the share of requests traced")
    ap.add_argument("--rounds", type=int, default=1, help="off/on pairs")
    ap.add_argument("pipeline", nargs=argparse.REMAINDER, help="-- then pipeline.py's arguments")
    args = ap.parse_args()
    rest = args.pipeline[1:] if args.pipeline[:1] == ["--"] else args.pipeline
    sink, server, url = serve_receiver()
    rows = []
    for _ in range(args.rounds):
        for on in (False, True):
            flags = ["--otlp-endpoint", url, "--otlp-sample-ratio", str(args.ratio)]
            before = (len(sink.spans), sink.bytes)
            row = run_pipeline([*rest, *(flags if on else [])])
            spans, nbytes = len(sink.spans) - before[0], sink.bytes - before[1]
            rows.append({"tracing": f"on {args.ratio:g}" if on else "off", **row, "spans": spans,
                         "otlp_kb": round(nbytes / 1024, 1)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    keys = ["tracing", "out_tok_s", "ttft_mean_s", "itl_mean_ms", "failed", "spans", "otlp_kb"]
    print("\n| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{row.get(k, '')}" if not isinstance(row.get(k), float) else f"{row[k]:.4g}"
                 for k in keys]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    off = [r["out_tok_s"] for r in rows if r["tracing"] == "off"]
    on = [r["out_tok_s"] for r in rows if r["tracing"] != "off"]
    print(f"\nthroughput with tracing on / off: {sum(on) / sum(off):.3f}")
    server.shutdown()


if __name__ == "__main__":
    main()
