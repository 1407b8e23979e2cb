"""On CUDA the kernels take float16 and bfloat16: ``splitserve up --device cuda`` serves a
float32 checkpoint in bfloat16 by itself (every node and the router get ``--dtype bfloat16``, so
the model identity agrees), and a node asked to serve float32 on CUDA, or given a float32
checkpoint without a ``--dtype``, is refused with its options (``splitserve prefill|decode``
runs ``check_cuda_dtype`` once the device is known to exist), not after its weights load.
Nothing here touches a GPU: the checks read the checkpoint's config.json."""

import json

import pytest

from splitserve.cli import serving_dtype
from splitserve.runtime.config import check_cuda_dtype


def checkpoint(tmp_path, dtype):
    folder = tmp_path / f"ckpt-{dtype}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["X"], "dtype": dtype}))
    return str(folder)


def test_float32_on_cuda_is_refused_at_parse_time(tmp_path):
    fp32, bf16 = checkpoint(tmp_path, "float32"), checkpoint(tmp_path, "bfloat16")
    with pytest.raises(ValueError, match="--dtype float32 on CUDA"):
        check_cuda_dtype(bf16, "float32")
    with pytest.raises(ValueError, match=r"stored in float32.*--dtype bfloat16"):
        check_cuda_dtype(fp32, None)
    with pytest.raises(ValueError, match="float32 on CUDA"):
        check_cuda_dtype(bf16, "torch.float32")  # any spelling
    # What serves: a 16-bit --dtype, a checkpoint's own 16-bit dtype.
    check_cuda_dtype(fp32, "bfloat16")
    check_cuda_dtype(fp32, "fp16")
    check_cuda_dtype(bf16, None)
    check_cuda_dtype(str(tmp_path / "not-a-checkpoint"), None)  # the loader says why later


def test_up_serves_a_float32_checkpoint_in_bfloat16_on_cuda(tmp_path):
    fp32, fp16 = checkpoint(tmp_path, "float32"), checkpoint(tmp_path, "float16")
    assert serving_dtype(fp32, "cuda", None) == "bfloat16"
    assert serving_dtype(fp32, "cuda:0", "float16") == "float16"
    assert serving_dtype(fp16, "cuda", None) is None  # its own dtype serves as is
    assert serving_dtype(fp32, "cpu", None) is None  # a CPU serves float32
    with pytest.raises(ValueError, match="float32 on CUDA"):
        serving_dtype(fp32, "cuda", "float32")
