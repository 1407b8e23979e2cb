"""How long a router process takes to start (launch to its port file: the tokenizer loaded and
the gRPC server listening) and the memory it holds then, with torch kept out (the default,
``router.request.keep_torch_out``) and let in (``SPLITSERVE_ROUTER_TORCH=1``).

    python3 router_start.py --runs 3                 # the embedded model's tokenizer
    python3 router_start.py --runs 3 --model tiny

Each run is a fresh process pointed at a decode node that does not exist (it never needs one to
start). Prints one row per setting: start seconds of each run, and the resident memory (RSS).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(model: str | None, torch: bool, folder: Path) -> tuple[float, float, bool]:
    """(seconds to the port file, RSS MB then, whether torch is mapped)."""
    port_file = folder / f"router-{time.monotonic_ns()}.port"
    cmd = [sys.executable, "-P", "-m", "splitserve.cli", "router", "--decode", "127.0.0.1:9"]
    cmd += ["--port", "0", "--port-file", str(port_file)]
    cmd += ["--model", model] if model else []
    env = dict(os.environ)
    env.pop("SPLITSERVE_ROUTER_TORCH", None)
    if torch:
        env["SPLITSERVE_ROUTER_TORCH"] = "1"
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None:
                sys.exit(f"the router exited ({proc.returncode}): {' '.join(cmd)}")
            time.sleep(0.01)
        seconds = time.monotonic() - start
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        return seconds, rss_mb(proc.pid), "libtorch" in maps
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the router's --model (default: the embedded)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        one(args.model, False, Path(tmp))  # converts/caches the model once, warms the file cache
        for torch in (False, True):
            runs = [one(args.model, torch, Path(tmp)) for _ in range(args.runs)]
            rows.append((torch, runs))
    print("| torch | start s (each run) | RSS MB (each run) | torch mapped |")
    print("|---|---|---|---|")
    for torch, runs in rows:
        starts = " / ".join(f"{s:.2f}" for s, _, _ in runs)
        rss = " / ".join(f"{r:.0f}" for _, r, _ in runs)
        mapped = (
            "yes"
            if all(m for _, _, m in runs)
            else "no"
            if not any(m for *_, m in runs)
            else "mixed"
        )
        label = "let in (SPLITSERVE_ROUTER_TORCH=1)" if torch else "kept out (default)"
        print(f"| {label} | {starts} | {rss} | {mapped} |")


if __name__ == "__main__":
    main()
