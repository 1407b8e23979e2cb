"""A GPU node stopped (SIGTERM) or killed outright (SIGKILL) leaves nothing holding the GPU:
its engine process (on by default on a GPU) goes with it (engine.lifeline) and the GPU's used
memory comes back to what it was before the node started. With two GPUs, the same for a node at
tensor parallelism 2 whose rank 1 is stopped (as in a collective that never returns). CPU
counterpart (the processes, not the memory): tests/cluster/test_nothing_outlives.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from support.processes import cmdline, descendants, start_node

from splitserve.engine.client import STOP_TIMEOUT_S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
    pytest.mark.timeout(300),
]
SLACK_MIB = 1024  # other tenants of a shared GPU may move a little meanwhile


def _used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [int(x) for x in out.split()]


def _wait_back(before: list[int], timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        now = _used_mib()
        if all(n <= b + SLACK_MIB for n, b in zip(now, before, strict=True)):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_stopped_or_killed_gpu_node_leaves_no_memory_held(tmp_path, tp, how):
    from splitserve.models.tiny import write_random_checkpoint

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    model = write_random_checkpoint(tmp_path / "m", dtype="bfloat16")
    before = _used_mib()
    # A KV cache of 3 GiB, so what the node holds stands well above SLACK_MIB (start_node's
    # 64 MB cache and a CUDA context come to ~950 MiB on an H100: within the slack).
    flags = ["--device", "cuda:0", "--kv-cache-mb", "3072", "--engine-process", "on"]
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp)]
    node = start_node("decode", model, tmp_path, *flags)
    try:
        held = _used_mib()
        assert held[0] > before[0] + SLACK_MIB, (before, held)  # it did take the GPU
        if tp > 1:
            below = descendants(node.popen.pid)
            ranks = [p for p in below if "splitserve.engine.ranks" in cmdline(p)]
            assert len(ranks) == tp - 1, [cmdline(p) for p in below]
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
        node.popen.send_signal(getattr(signal, how))
        # SIGTERM: its drain (nothing in flight), then at most STOP_TIMEOUT_S for its engine.
        node.popen.wait(STOP_TIMEOUT_S + 60)
        after = _wait_back(before)
        assert all(a <= b + SLACK_MIB for a, b in zip(after, before, strict=True)), (
            f"GPU memory (MiB) before the node {before}, while it ran {held}, after it was "
            f"stopped {after}"
        )
    finally:
        node.stop()
