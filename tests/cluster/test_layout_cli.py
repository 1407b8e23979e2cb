"""The layout commands as a user runs them: ``splitserve calibrate`` measures the tiny model's
engine and writes a rates file the search reads; ``splitserve layout`` ranks the layouts of N
GPUs; ``splitserve up --num-prefill auto`` starts the best one (here on the CPU: the
``--num-decode`` nodes split by the search), and says why. The search itself, against measured
GPU figures: tests/unit/test_layout.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.planner.calibrate import load_rates

CLI = [sys.executable, "-P", "-m", "splitserve.cli"]
# One H200's engine with the Llama-3-8B shape (tests/unit/test_layout.py says where from).
H200_8B = {
    "prefill_tokens_per_s": 36700,
    "step_base_s": 0.0052,
    "step_per_seq_s": 3.6e-5,
    "transfer_s": 0.005,
}


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_calibrate_writes_rates_that_layout_ranks(tmp_path):
    out = tmp_path / "rates.json"
    done = run(
        "calibrate", "--model", "tiny", "--device", "cpu", "--kv-cache-mb", "32",
        "--prompt-tokens", "32", "--batches", "1,4,8", "--steps", "3", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rates = load_rates(out)
    assert rates.prefill_tokens_per_s > 0 and rates.step_base_s > 0 and rates.step_per_seq_s >= 0
    measured = json.loads(out.read_text())["measured"]
    assert set(measured["decode_step_s"]) == {"1", "4", "8"} and measured["device"] == "cpu"

    workload = "rate=1,prompt=32,output=8"
    done = run(
        "layout", "--rates", str(out), "--gpus", "2", "--slo", "ttft=5,tpot=1",
        "--workload", workload,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "x TP" in line]
    assert len(rows) == 2, done.stdout  # 2 colocated, or 1 prefill + 1 decode
    done = run(
        "layout", "--rates", str(out), "--gpus", "2", "--slo", "ttft=5", "--workload", workload
    )
    assert done.returncode == 2 and "both targets" in done.stderr


@pytest.mark.slow
def test_up_num_prefill_auto_starts_the_layout_the_slo_needs(tmp_path):
    rates = tmp_path / "h200.json"
    rates.write_text(json.dumps(H200_8B))
    # A TPOT target that stretched colocated steps miss: one prefill node and one decode node.
    argv = [
        *CLI, "up", "--model", "tiny", "--port", "0", "--api-key-file", "none",
        "--num-prefill", "auto", "--num-decode", "2", "--rates", str(rates),
        "--workload", "rate=28,prompt=1152,output=128", "--slo", "ttft=1,tpot=10ms",
    ]  # fmt: skip
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert up.stdout is not None
        while not (line := up.stdout.readline()).startswith("ready:"):
            assert line, "up exited:\n" + "".join(lines[-40:])
            lines.append(line)
    finally:
        # Stopping is not what this test checks: read up's output to its end (so it never blocks
        # writing its stop's log lines into a full pipe) and give a loaded machine time.
        up.terminate()
        try:
            up.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    text = "".join(lines)
    assert "layout: 1 prefill x TP 1 + 1 decode x TP 1" in text, text
    roles = [line.split()[0] for line in lines if line.split()[:1] in (["prefill"], ["decode"])]
    assert sorted(roles) == ["decode", "prefill"], text

    # Without what the search needs: a clear refusal, nothing started.
    done = run("up", "--model", "tiny", "--num-prefill", "auto", timeout=120)
    assert done.returncode == 2 and "--num-prefill auto needs --rates, --workload, --slo" in (
        done.stderr + done.stdout
    )
