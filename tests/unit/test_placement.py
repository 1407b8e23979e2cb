"""Where `splitserve up` puts its nodes: with --device cuda, one per GPU round robin over --gpus
(default: every visible GPU), each with the memory share of the nodes on its GPU — the layout of a
compose deployment. (A GPU run starts them; this checks the plan on any machine.)"""

import pytest

from splitserve.launcher import ClusterSpec, parse_gpus


def spec(**kw) -> ClusterSpec:
    return ClusterSpec(model_path="m", **kw)


def test_cuda_spreads_nodes_over_every_visible_gpu_with_its_full_share():
    plan = spec(num_prefill=2, num_decode=2, device="cuda").placement(num_gpus=4)
    assert plan == [("cuda:0", 0.9), ("cuda:1", 0.9), ("cuda:2", 0.9), ("cuda:3", 0.9)]


def test_more_nodes_than_gpus_share_them_evenly():
    plan = spec(num_prefill=1, num_decode=2, device="cuda").placement(num_gpus=2)
    assert plan == [("cuda:0", 0.45), ("cuda:1", 0.9), ("cuda:0", 0.45)]


def test_gpus_chooses_which_and_an_explicit_device_or_share_is_kept():
    assert [d for d, _ in spec(device="cuda", gpus="3,1").placement(num_gpus=8)] == [
        "cuda:3",
        "cuda:1",
    ]
    assert spec(device="cuda:2").placement(num_gpus=8) == [("cuda:2", 0.45)] * 2
    assert spec(device="cuda", gpu_memory_utilization=0.3).placement(4) == [
        ("cuda:0", 0.3),
        ("cuda:1", 0.3),
    ]
    assert spec(device="cpu").placement(num_gpus=0) == [("cpu", None)] * 2


@pytest.mark.parametrize("bad", ["", "a,b", "-1", "0,,x"])
def test_bad_gpu_lists_are_refused(bad):
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus(bad)


def test_tensor_parallel_nodes_take_runs_of_consecutive_gpus():
    tp = ClusterSpec(model_path="m", device="cuda", num_prefill=1, num_decode=2, prefill_tp=4,
                     decode_tp=2)  # fmt: skip
    assert tp.placement(8) == [("cuda:0", 0.9), ("cuda:4", 0.9), ("cuda:6", 0.9)]
    # a pool's size defaults to --tensor-parallel-size
    both = ClusterSpec(model_path="m", device="cuda", num_prefill=1, tensor_parallel_size=2)
    assert [d for d, _ in both.placement(4)] == ["cuda:0", "cuda:2"]
    # more ranks than GPUs: nodes share the runs and split their memory
    shared = ClusterSpec(model_path="m", device="cuda", num_prefill=1, tensor_parallel_size=2)
    assert shared.placement(2) == [("cuda:0", 0.45), ("cuda:0", 0.45)]
    with pytest.raises(ValueError, match="needs 2 consecutive GPUs"):
        ClusterSpec(
            model_path="m", device="cuda", gpus="0,3", decode_tp=2, num_prefill=0
        ).placement(4)
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        ClusterSpec(
            model_path="m", device="cuda", gpus="0,1", decode_tp=4, num_prefill=0
        ).placement(4)
    with pytest.raises(ValueError, match="--decode-tp must be >= 1"):
        ClusterSpec(model_path="m", decode_tp=0)
