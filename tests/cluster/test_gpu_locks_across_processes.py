"""--gpu-lock-dir across processes: a lock another process holds is skipped and released when that
process ends, and a node started with no GPU left exits with the reason (the claims within one
process: tests/unit/test_gpus.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from splitserve.runtime.gpus import claim_gpu

EXE = shutil.which("splitserve", path=str(Path(sys.executable).parent))


def test_a_lock_held_by_another_process_is_skipped_and_released_when_it_ends(tmp_path):
    locks = tmp_path / "locks"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from splitserve.runtime.gpus import claim_gpu; "
            f"print(claim_gpu({str(locks)!r}, ['a', 'b'])[0], flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "a"
        gpu, fd = claim_gpu(locks, ["a", "b"])
        assert gpu == "b"
        os.close(fd)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    gpu, fd = claim_gpu(locks, ["a", "b"])
    assert gpu == "a"
    os.close(fd)


def test_a_node_with_no_gpu_left_exits_with_the_reason(tmp_path):
    locks = tmp_path / "locks"
    _, fd = claim_gpu(locks, ["7"])
    try:
        proc = subprocess.run(
            [EXE, "prefill", "--device", "cuda"],
            env={
                "PATH": str(Path(sys.executable).parent),
                "HOME": str(tmp_path),
                "CUDA_VISIBLE_DEVICES": "7",
                "SPLITSERVE_GPU_LOCK_DIR": str(locks),
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(fd)
    assert proc.returncode == 1
    assert "all 1 GPUs visible here are held by other nodes" in proc.stderr
    assert "Traceback" not in proc.stderr
