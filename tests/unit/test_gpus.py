"""--gpu-lock-dir: every node of a host claims a GPU of its own (splitserve/gpus.py)."""

import os
from pathlib import Path

import pytest

from splitserve.runtime import gpus
from splitserve.runtime.gpus import GpuClaimError, claim_for_node, claim_gpu, visible_gpus

UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]


def _fake_driver(tmp_path: Path, minors_present: set[int]) -> tuple[Path, Path]:
    """/proc/driver/nvidia/gpus with 4 GPUs (bus order != minor order) and /dev nodes for some."""
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    dev.mkdir(parents=True)
    for i, (bus, minor) in enumerate(
        [("0000:18:00.0", 1), ("0000:2a:00.0", 0), ("0000:3a:00.0", 2), ("0000:5d:00.0", 3)]
    ):
        entry = proc / bus
        entry.mkdir(parents=True)
        (entry / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 1{i}\nGPU UUID: \t {UUIDS[i]}\n"
            f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n"
        )
        if minor in minors_present:
            (dev / f"nvidia{minor}").touch()
    return proc, dev


@pytest.fixture
def release_held():
    yield
    while gpus._held:
        os.close(gpus._held.pop())


def test_visible_gpus_from_the_driver_in_bus_order(tmp_path):
    proc, dev = _fake_driver(tmp_path, {0, 1, 2, 3})
    assert visible_gpus({}, proc, dev) == UUIDS
    # a container given GPUs with minors 0 and 3 has only those device nodes
    proc, dev = _fake_driver(tmp_path / "c", {0, 3})
    assert visible_gpus({}, proc, dev) == [UUIDS[1], UUIDS[3]]


def test_cuda_visible_devices_wins(tmp_path):
    proc, dev = _fake_driver(tmp_path, {0, 1, 2, 3})
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}, proc, dev) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, proc, dev) == UUIDS


def test_each_claim_gets_a_different_gpu_until_none_is_left(tmp_path):
    locks = tmp_path / "locks"
    first, fd1 = claim_gpu(locks, UUIDS[:3])
    second, fd2 = claim_gpu(locks, UUIDS[:3])
    third, fd3 = claim_gpu(locks, UUIDS[:3])
    assert [first, second, third] == UUIDS[:3]
    with pytest.raises(GpuClaimError, match="all 3 GPUs visible here are held by other nodes"):
        claim_gpu(locks, UUIDS[:3])
    os.close(fd2)  # that node ended: its GPU is free again
    again, fd4 = claim_gpu(locks, UUIDS[:3])
    assert again == UUIDS[1]
    assert (locks / f"gpu-{UUIDS[1]}.lock").read_text().startswith(f"pid {os.getpid()} on ")
    for fd in (fd1, fd3, fd4):
        os.close(fd)


def test_no_gpu_and_an_unusable_lock_dir_are_clear_errors(tmp_path):
    with pytest.raises(GpuClaimError, match="no NVIDIA GPU is visible"):
        claim_gpu(tmp_path, [])
    (tmp_path / "file").touch()
    with pytest.raises(GpuClaimError, match="cannot create the GPU lock directory"):
        claim_gpu(tmp_path / "file" / "locks", ["a"])


def test_claim_for_node(tmp_path, release_held):
    env = {"CUDA_VISIBLE_DEVICES": "3,4"}
    assert claim_for_node("cpu", str(tmp_path), env) is None
    assert claim_for_node("cuda:1", str(tmp_path), env) is None
    assert claim_for_node("cuda", None, env) is None
    assert env == {"CUDA_VISIBLE_DEVICES": "3,4"}
    assert claim_for_node("cuda", str(tmp_path), env) == "cuda:0"  # GPU "3"
    assert env == {"CUDA_VISIBLE_DEVICES": "3,4"}  # every GPU stays visible, in the order tried
    env = {"CUDA_VISIBLE_DEVICES": "3,4"}
    assert claim_for_node("cuda", str(tmp_path), env) == "cuda:1"  # "3" is held: GPU "4"


def test_a_tensor_parallel_node_claims_its_gpus_all_or_none_and_computes_on_the_first(
    tmp_path, release_held
):
    locks = tmp_path / "locks"
    env = {"CUDA_VISIBLE_DEVICES": ",".join(UUIDS)}
    # another node holds GPU 1: a TP 2 node takes 0 and 2, listed first (its ranks: cuda:0, 1)
    held, fd = claim_gpu(locks, [UUIDS[1]])
    assert held == UUIDS[1]
    try:
        assert claim_for_node("cuda", str(locks), env, count=2) == "cuda:0"
        assert env["CUDA_VISIBLE_DEVICES"].split(",") == [UUIDS[0], UUIDS[2], UUIDS[1], UUIDS[3]]
        # one GPU left: a second TP 2 node claims none (its partial claim is given back)
        env2 = {"CUDA_VISIBLE_DEVICES": ",".join(UUIDS)}
        with pytest.raises(GpuClaimError, match="tensor parallel size 2 needs 2 GPUs"):
            claim_for_node("cuda", str(locks), env2, count=2)
        last, fd3 = claim_gpu(locks, UUIDS)
        assert last == UUIDS[3]
        os.close(fd3)
    finally:
        os.close(fd)


def test_a_child_counts_the_locks_its_parent_passed_as_its_own(tmp_path, release_held):
    _, fd = claim_gpu(tmp_path / "locks", UUIDS[:1])
    gpus.inherit_locks(f"{fd},999999,x")  # a closed descriptor and garbage are skipped
    assert gpus.held_locks() == (fd,)
