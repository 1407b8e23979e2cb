"""The compiled Triton kernels on a CUDA GPU at realistic shapes (bf16 and fp16) against the
float32 reference on CPU: `pytest tests/gpu -m gpu` (compiled: tests/conftest.py leaves
TRITON_INTERPRET at 0 where CUDA is present)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from support.paged_kv import make_paged_kv

from splitserve import kernels
from splitserve.kernels import layout, reference
from splitserve.kernels.decode_attention import paged_decode_attention
from splitserve.kernels.prefill_attention import PrefillConfig, paged_prefill_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU; CPU counterpart: tests/unit/test_kernels_triton.py (the interpreter)",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 was set by hand: the GPU tests need the compiled kernels",
    ),
]

# 16-bit kernel vs float32 reference on the same 16-bit inputs: the kernel rounds softmax
# probabilities and the output to 16 bits. Relative L2 error and worst element.
REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
MAX_ABS = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
BS = 16
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def gen(rng) -> torch.Generator:
    seed = rng.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got = got.float().cpu()
    assert not got.isnan().any(), "NaN in output (unwritten element or unmasked garbage)"
    rel = float((got - want).norm() / want.norm())
    worst = float((got - want).abs().max())
    assert rel <= REL_L2[dtype] and worst <= MAX_ABS[dtype], (rel, worst)


def cpu_float(kv):
    """The reference's inputs: the same values, float32, on CPU."""
    return (
        kv.key_cache.float().cpu(),
        kv.value_cache.float().cpu(),
        kv.block_table.cpu(),
        kv.seq_lens.cpu(),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "num_splits"),
    [((32, 8, 128), None), ((32, 8, 128), 1), ((16, 2, 64), None), ((8, 8, 128), 7)],
)
def test_decode_gpu(gen, dtype, heads, num_splits):
    hq, hkv, d = heads
    lens = [1, BS - 1, BS, BS + 1, 8192, *torch.randint(1, 4097, (11,), generator=gen).tolist()]
    kv = make_paged_kv(lens, hkv, d, BS, dtype, "cuda", gen, spare_blocks=50)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    want = reference.paged_decode_attention(q.float(), *cpu_float(kv), d**-0.5)
    out = torch.full_like(q, float("nan"), device="cuda")
    paged_decode_attention(
        q.cuda(),
        kv.key_cache,
        kv.value_cache,
        kv.block_table,
        kv.seq_lens,
        d**-0.5,
        out=out,
        num_splits=num_splits,
    )
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 2, 64)])
@pytest.mark.parametrize("max_new", [4096, 700, 100])  # each picks another tiling
def test_prefill_gpu(gen, dtype, heads, max_new):
    hq, hkv, d = heads
    # (context, new tokens): whole prompts, cached prefixes, chunked-prefill tails.
    shapes = [
        (1, 1),
        (BS - 1, BS - 1),
        (BS, BS),
        (BS + 1, BS + 1),
        (2048, 2048),
        (1500, 333),
        (700, 1),
        (4096, 1000),
    ]
    shapes = [(c, min(n, max_new)) for c, n in shapes]
    random.Random(int(torch.randint(1 << 30, (1,), generator=gen))).shuffle(shapes)
    kv = make_paged_kv([c for c, _ in shapes], hkv, d, BS, dtype, "cuda", gen)
    q_lens = torch.tensor([n for _, n in shapes])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype)
    key, value, table, seq_lens = cpu_float(kv)
    want = reference.paged_prefill_attention(q.float(), key, value, table, cu, seq_lens, d**-0.5)
    out = torch.full_like(q, float("nan"), device="cuda")
    paged_prefill_attention(
        q.cuda(),
        kv.key_cache,
        kv.value_cache,
        kv.block_table,
        cu.cuda(),
        kv.seq_lens,
        d**-0.5,
        out=out,
    )
    assert_close(out, want, dtype)


@pytest.mark.parametrize(
    "config",
    [
        PrefillConfig(256, 64, 8, 5),
        PrefillConfig(256, 64, 16, 5),
        PrefillConfig(128, 128, 8, 5),
        PrefillConfig(128, 64, 8, 5),
        PrefillConfig(64, 64, 4, 5),
    ],
)
def test_prefill_gpu_five_stage_tilings(gen, config):
    """The 5-stage tilings of benchmarks/attention_kernels.py's prefill sweep (three K/V buffers:
    another pipeline than 3-4 stages compile to) against the reference."""
    shapes = [(1, 1), (BS + 1, BS + 1), (2048, 2048), (1500, 333), (4096, 1000)]
    kv = make_paged_kv([c for c, _ in shapes], 8, 128, BS, torch.bfloat16, "cuda", gen)
    q_lens = torch.tensor([n for _, n in shapes])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(cu[-1]), 32, 128, generator=gen).to(torch.bfloat16)
    key, value, table, seq_lens = cpu_float(kv)
    want = reference.paged_prefill_attention(q.float(), key, value, table, cu, seq_lens, 128**-0.5)
    out = torch.full_like(q, float("nan"), device="cuda")
    paged_prefill_attention(q.cuda(), kv.key_cache, kv.value_cache, kv.block_table, cu.cuda(),
                            kv.seq_lens, 128**-0.5, out=out, config=config)  # fmt: skip
    assert_close(out, want, torch.bfloat16)


def test_reshape_and_cache_gpu_byte_exact(gen):
    kv = make_paged_kv([3000, 17], 8, 128, BS, torch.bfloat16, "cuda", gen, spare_blocks=300)
    num_slots = kv.key_cache.shape[0] * BS
    written = torch.zeros(num_slots, dtype=torch.bool)
    for b, n in enumerate(kv.seq_lens.tolist()):
        pos = torch.arange(n)
        written[kv.block_table[b].cpu().long()[pos // BS] * BS + pos % BS] = True
    written[:BS] = True  # never the null block
    free = (~written).nonzero()[:, 0]
    slots = free[torch.randperm(len(free), generator=gen)[:4000]]
    slots = torch.cat([slots, torch.full((96,), -1)])[torch.randperm(4096, generator=gen)]
    key = torch.randn(4096, 8, 128, generator=gen).to(torch.bfloat16)
    value = torch.randn(4096, 8, 128, generator=gen).to(torch.bfloat16)
    want = kv.kv_pool.cpu()
    reference.reshape_and_cache(key, value, want[:, 1, 0], want[:, 1, 1], slots)
    kernels.reshape_and_cache(key.cuda(), value.cuda(), kv.key_cache, kv.value_cache, slots.cuda())
    assert torch.equal(kv.kv_pool.cpu().view(torch.int16), want.view(torch.int16))


def test_block_transfer_gpu_to_pinned_host_and_back(gen):
    pool = layout.allocate_kv_pool(300, 4, BS, 8, 128, torch.bfloat16, "cuda")
    pool.view(torch.int16).random_(-(2**15), 2**15)
    ids = torch.randperm(299, generator=gen)[:64] + 1
    staging = torch.empty((64, *pool.shape[1:]), dtype=pool.dtype, pin_memory=True)
    layout.gather_blocks(pool, ids.cuda(), out=staging)
    torch.cuda.synchronize()
    dst = torch.zeros_like(pool)
    targets = torch.randperm(299, generator=gen)[:64] + 1
    layout.scatter_blocks(dst, targets.cuda(), staging)
    assert torch.equal(dst[targets.cuda()].view(torch.int16), pool[ids.cuda()].view(torch.int16))


def test_decode_in_cuda_graph_replays_with_new_lengths(gen):
    kv = make_paged_kv([100, 2000, 37], 8, 128, BS, torch.bfloat16, "cuda", gen)
    q = torch.randn(3, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    seq_lens = kv.seq_lens.clone()

    def step():
        kernels.paged_decode_attention(
            q, kv.key_cache, kv.value_cache, kv.block_table, seq_lens, 0.088, out=out
        )

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seq_lens.copy_(torch.tensor([99, 1500, 1], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    key, value, table, _ = cpu_float(kv)
    want = reference.paged_decode_attention(
        q.float().cpu(), key, value, table, seq_lens.cpu(), 0.088
    )
    assert_close(out, want, torch.bfloat16)
