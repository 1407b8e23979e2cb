"""How long a prefill or decode node process takes to start (launch to SERVING on its health
service) and the CPU seconds it spent getting there, with its checkpoint's config.json read
directly (``models.config.plain_config``: the default for a plain config) and through
transformers' AutoConfig (forced by an ``auto_map`` entry in a copy of the checkpoint, which the
direct reading leaves to AutoConfig).

    python3 node_start.py --runs 3                  # the random tiny checkpoint, on the CPU
    python3 node_start.py --runs 3 --role decode

Each run is a fresh ``splitserve prefill|decode`` process with a 64 MB KV cache, stopped once it
serves. Prints one row per reading: each run's seconds to SERVING and CPU seconds (user +
system, from /proc) at that moment, and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.engine import lifeline


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def one(role: str, model: Path, folder: Path) -> tuple[float, float]:
    """(seconds to SERVING, CPU seconds then) of one fresh node process."""
    port_file = folder / f"{role}-{time.monotonic_ns()}.port"
    cmd = [sys.executable, "-P", "-m", "splitserve.cli", role, "--model", str(model)]
    cmd += ["--kv-cache-mb", "64", "--port", "0", "--port-file", str(port_file)]
    start = time.monotonic()
    # (SIGTERM when this script ends, however it ends: no node outlives the benchmark)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lifeline.term_with_parent,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
            if port_file.exists() and serving(f"127.0.0.1:{port_file.read_text().strip()}"):
                return time.monotonic() - start, cpu_s(proc.pid)
            if time.monotonic() - start > 120:
                raise RuntimeError("not SERVING after 120 s")
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--role", choices=("prefill", "decode"), default="prefill")
    args = parser.parse_args()
    from splitserve.models.tiny import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plain = write_random_checkpoint(folder / "plain", "LlamaForCausalLM", seed=7)
        auto = folder / "auto"
        shutil.copytree(plain, auto)
        config = json.loads((auto / "config.json").read_text())
        config["auto_map"] = {}  # (plain_config leaves such a config to AutoConfig)
        (auto / "config.json").write_text(json.dumps(config))
        rows = []
        for name, model in (("config.json read directly", plain), ("AutoConfig", auto)):
            runs = [one(args.role, model, folder) for _ in range(args.runs)]
            rows.append((name, runs))
    print(f"\n{args.role} node start, {args.runs} runs each\n")
    print("| config read by | seconds to SERVING | CPU seconds | median s / CPU s |")
    print("|---|---|---|---|")
    for name, runs in rows:
        wall = " / ".join(f"{w:.2f}" for w, _ in runs)
        cpu = " / ".join(f"{c:.2f}" for _, c in runs)
        medians = f"{statistics.median(w for w, _ in runs):.2f} / "
        medians += f"{statistics.median(c for _, c in runs):.2f}"
        print(f"| {name} | {wall} | {cpu} | {medians} |")


if __name__ == "__main__":
    main()
