"""FP8 linear layers on a GPU with FP8 tensor cores: ``torch._scaled_mm`` against the float32
emulation at real shapes, and an FP8 model served with CUDA graphs giving the tokens of the same
model run eagerly (skipped without such a GPU; the CPU counterpart, which checks the emulation
against transformers, is tests/unit/test_fp8_weights.py)."""

import pytest
import torch

from splitserve.engine.core import LLMEngine
from splitserve.kernels import quant
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint


def _has_fp8() -> bool:
    return torch.cuda.is_available() and quant.fp8_supported(torch.device("cuda", 0))[0]


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _has_fp8(),
        reason="no CUDA GPU with FP8 (compute capability >= 8.9); CPU counterpart: "
        "tests/unit/test_fp8_weights.py",
    ),
]


@pytest.mark.parametrize("m", [1, 7, 64, 257, 2048])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_scaled_mm_matches_the_emulation(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    qw, sw = quant.quantize_weight(w)
    native = quant.fp8_linear(x, qw, sw, native=True)
    emulated = quant.fp8_linear(x.float(), qw, sw, native=False)
    assert native.dtype == torch.bfloat16
    # The same FP8 products; the sums' order and the bfloat16 output rounding differ.
    rel = ((native.float() - emulated).norm() / emulated.norm()).item()
    assert rel < 1e-2, rel


def test_an_fp8_model_serves_the_same_tokens_with_and_without_cuda_graphs(tmp_path):
    path = write_random_checkpoint(
        tmp_path,
        seed=5,
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        initializer_range=0.02,
    )
    prompts = [[(7 * i + j) % 2048 for j in range(n)] for i, n in enumerate((5, 33, 100, 250))]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for graphs in (False, True):
        config, model = load_model(path, dtype="bfloat16", device="cuda", quantization="fp8")
        runner = ModelRunner(
            config, model, RunnerConfig(use_cuda_graph=graphs, gpu_memory_utilization=0.3)
        )
        engine = LLMEngine(runner, ModelIdentity(str(path), dtype="bfloat16", quantization="fp8"))
        outs.append([r.output_token_ids for r in engine.generate(prompts, greedy)])
        assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
    assert outs[0] == outs[1]
