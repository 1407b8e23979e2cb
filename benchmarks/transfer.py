"""KV block transfer between two processes, per path of the transfer layer (transfer/).

    python benchmarks/transfer.py --device cuda [--paths ipc nixl dist tcp grpc]
        [--blocks 1 16 256 4096]
    python benchmarks/transfer.py --device cpu --blocks 1 16 --small     # a quick check on CPU
    python benchmarks/transfer.py --device cuda --paths tcp --tls --blocks 16 256 4096  # TLS cost

Blocks of Llama-3-8B's KV shape (32 layers, 8 KV heads, head_dim 128, block size 16, bf16: 2 MiB
a block; ``--small``: 2 layers, 2 KV heads, head_dim 64, 16 KiB) move from a sender process's
pool into random reserved blocks of this process's pool (grpc: into a receiver process), source
and destination ids shuffled. One warm-up transfer per case, then ``--repeats`` timed ones; the
table has the median time, and GB/s (10^9 bytes) of the median and best. Every case checks the
destination blocks against the source (per-block checksums across the processes).

- ``ipc`` (CUDA, both processes on one GPU): the sender's ``KVSender.send`` (gather, copy into
  the mapped pool, synchronize), timed in the sender.
- ``nixl`` (CPU or CUDA, both processes on one GPU; needs the nixl extra): one WRITE request of
  the sender's NIXL agent into the receiver's registered pool, timed in the sender until NIXL
  says it is done. UCX picks the transport (on one GPU: cuda_ipc); ``UCX_TLS=tcp,cuda_copy,self``
  in the environment forces TCP (the row to set against ``tcp``).
- ``dist`` (gloo on CPU; NCCL on CUDA, which needs two GPUs: receiver cuda:0, sender cuda:1):
  from the command to the sender until ``KVReceiver.receive`` returned (blocks in the pool).
- ``tcp`` (CPU or CUDA, both processes on one GPU): the raw-socket path, from the command
  to the sender until ``KVReceiver.receive`` returned (blocks in the pool): gather into pinned
  memory, 16 MiB CRC-32 checked chunks over 4 loopback connections, one scatter per chunk.
  ``--tls``: each tcp case again inside mutual TLS 1.3 (rows ``tcp+tls``: both processes present
  a certificate of a CA made here with the openssl CLI, as nodes started with ``--tls-*`` do).
- ``grpc``: the services' byte path over a loopback gRPC stream (``transfer.grpc_bytes.codec``
  messages of ~4 MB, CRC-32 checked, staged, then one ``write_blocks_bytes``), from the first
  message until the receiver answered.

Cases that do not fit in memory (host or GPU) are skipped; on CPU the default leaves out 4096
blocks (8 GiB).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

# The tests' pools and certificates (tests/support: not part of the installed package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from support.kv_pools import (
    SenderProcess,
    block_checksums,
    fill_pool,
    make_pool,
    security_of,
)
from transfer_cases import RECEIVER_SEED, SENDER_SEED, Case, pick_ids, verify
from transfer_grpc import run_grpc

from splitserve.transfer import DIST, GRPC, IPC, NIXL, TCP, open_receiver
from splitserve.transfer.reservation import block_nbytes


def kv_shape(small: bool) -> dict:
    if small:
        return dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64)
    from shapes import llama3_8b_config

    cfg = llama3_8b_config()
    return dict(
        num_layers=cfg.num_hidden_layers,
        block_size=16,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
    )


def host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gpu_available_bytes(index: int) -> int:
    return torch.cuda.mem_get_info(index)[0]


def run_layer_path(
    path: str, args, spec: dict, counts: list[int], out: list[Case], tls: dict | None = None
) -> None:
    """ipc, dist or tcp: this process receives (a KVReceiver of that path alone), a spawned
    process sends (a KVSender); ``tls``: both sides' certificate files (``security_of``'s
    ``tls``), the row named ``path+tls``."""
    device = args.device
    pool_blocks = max(counts) + 1
    rx_device = "cuda:0" if device == "cuda" else "cpu"
    tx_device = rx_device
    if path == DIST and device == "cuda":
        tx_device = "cuda:1"
    rx_pool = fill_pool(make_pool(pool_blocks, **spec, device=rx_device), RECEIVER_SEED)
    nbytes = block_nbytes(rx_pool)
    security = {"tls": tls} if tls else None
    rx = open_receiver(
        rx_pool,
        "bench-decode",
        paths=(path,),
        host="127.0.0.1",
        connect_timeout=60.0,
        security=security_of(security),
    )
    tx_spec = dict(num_blocks=pool_blocks, **spec, device=tx_device)
    sender = SenderProcess(
        "bench-prefill", tx_spec, SENDER_SEED, connect_timeout=60.0, security=security
    )
    label = f"{path}+tls" if tls else path
    rng = random.Random(0)
    try:
        sender.wait_ready(timeout=600)
        chosen = sender.call("connect", rx.endpoint().to_bytes(), timeout=120)
        if chosen != path:
            raise RuntimeError(f"the sender chose {chosen!r}, not {path!r}")
        for n in counts:
            case = Case(label, n, n * nbytes)
            src, dst = pick_ids(pool_blocks, n, rng), pick_ids(pool_blocks, n, rng)
            for i in range(args.repeats + 1):
                res = rx.reserve(sender.node_id, dst, path)
                t0 = time.perf_counter()
                sender.request("send", res.ticket.to_bytes(), src, 300.0)
                if path in (IPC, NIXL):  # only the sender knows when its write is in: timed there
                    _, elapsed = sender.reply(timeout=300)
                else:  # dist receives the blocks, tcp's receive waits for its chunks
                    rx.receive(res, 300.0)
                    elapsed = time.perf_counter() - t0
                    sender.reply(timeout=300)
                rx.finish(res)
                if i:
                    case.seconds.append(elapsed)
            if rx_pool.device.type == "cuda":
                torch.cuda.synchronize()
            verify(case, sender.call("checksums", src, timeout=300), block_checksums(rx_pool, dst))
            out.append(case)
            print(case.row(), flush=True)
    finally:
        sender.stop()
        rx.shutdown()


def fits(path: str, device: str, n: int, nbytes: int, small_cpu_default: bool) -> str | None:
    """Why ``n`` blocks cannot run here (None: they can)."""
    size = n * nbytes
    if device == "cpu" and small_cpu_default and size > (1 << 30):
        return "GPU-only by default (pass --blocks explicitly)"
    if device == "cuda":
        # ipc: both pools and the sender's gather buffer on one GPU; dist: pool + buffer per GPU.
        need = 3 * size if path in (IPC, NIXL) else 2 * size
        if need > 0.85 * gpu_available_bytes(0):
            return f"needs {need / (1 << 30):.1f} GiB on the GPU"
        host_need = {GRPC: 6 * size, TCP: 2 * size}.get(path, 0)
    else:
        host_need = {IPC: 0, NIXL: 2 * size, DIST: 4 * size, TCP: 4 * size, GRPC: 7 * size}[path]
    if host_need > 0.8 * host_available_bytes():
        return f"needs {host_need / (1 << 30):.1f} GiB of host memory"
    return None


def make_certificates() -> tuple[str, str, str]:
    """(cert, key, ca) of a CA made for this run (in a temporary folder kept until exit)."""
    import atexit
    import shutil
    import tempfile

    from support.pki import HAVE_OPENSSL, make_pki, tls_triple

    if not HAVE_OPENSSL:
        sys.exit("--tls: making the certificates needs the openssl CLI")
    folder = Path(tempfile.mkdtemp(prefix="kv-tls-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return tls_triple(make_pki(folder / "pki"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    paths = [IPC, NIXL, DIST, TCP, GRPC]
    ap.add_argument("--paths", nargs="+", choices=paths, default=paths)
    ap.add_argument("--blocks", nargs="+", type=int, default=None, help="default: 1 16 256 4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a small block (16 KiB) for quick checks")
    ap.add_argument(
        "--tls",
        action="store_true",
        help="also run each tcp case inside mutual TLS 1.3 (rows tcp+tls; needs the openssl CLI)",
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA GPU here")
    explicit = args.blocks is not None
    blocks = args.blocks or [1, 16, 256, 4096]
    spec = kv_shape(args.small)
    nbytes = block_nbytes(make_pool(2, **spec))
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()})"
    print(
        f"KV transfer, two processes, {where}, torch {torch.__version__}; block "
        f"{spec['num_layers']} layers x 2 x {spec['block_size']} x {spec['num_kv_heads']} heads "
        f"x {spec['head_dim']} bf16 = {nbytes / 1024:.0f} KiB; {args.repeats} repeats\n"
    )
    print("| path | blocks | MiB | median ms | GB/s (median) | GB/s (best) | check |")
    print("|---|---:|---:|---:|---:|---:|---|")
    results: list[Case] = []
    notes: list[str] = []
    for path in args.paths:
        if path == IPC and args.device != "cuda":
            notes.append("ipc: needs CUDA (--device cuda)")
            continue
        if path == NIXL:
            from splitserve.transfer import nixl

            if not nixl.available():
                notes.append("nixl: NIXL is not installed (pip install 'splitserve[nixl]')")
                continue
        if path == DIST and args.device == "cuda" and torch.cuda.device_count() < 2:
            notes.append("dist: NCCL cannot pair two processes on one GPU; needs two GPUs")
            continue
        counts = []
        for n in blocks:
            why = fits(path, args.device, n, nbytes, small_cpu_default=not explicit)
            if why:
                case = Case(path, n, n * nbytes)
                case.note = f"skipped: {why}"
                print(case.row(), flush=True)
            else:
                counts.append(n)
        if not counts:
            continue
        if path == GRPC:
            run_grpc(args, spec, counts, results)
        else:
            run_layer_path(path, args, spec, counts, results)
            if path == TCP and args.tls:
                run_layer_path(path, args, spec, counts, results, tls=make_certificates())
    for note in notes:
        print(f"\n{note}")
    if any(c.check == "MISMATCH" for c in results):
        sys.exit("some transfers were not byte-exact")


if __name__ == "__main__":
    main()
