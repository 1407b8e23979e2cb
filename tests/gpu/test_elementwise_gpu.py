"""Fused per-token kernels compiled for the GPU, bf16, against the torch references run on the
same CUDA tensors (skipped without a GPU; CPU counterpart:
tests/unit/test_kernels_elementwise.py)."""

import pytest
import torch

from splitserve.kernels import elementwise, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU; CPU counterpart: tests/unit/test_kernels_elementwise.py",
    ),
]
BF16 = dict(atol=2e-2, rtol=2e-2)  # about two bf16 ulps: the references round more often


def test_rms_norm_with_residual_bf16():
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    res_ref = res.clone()
    out = elementwise.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-5, res_ref), **BF16)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)  # the sum is rounded once in both


def test_rotary_and_silu_bf16():
    t, hq, hkv, d = 300, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.arange(8192, device="cuda").float()[:, None] * inv
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    pos = torch.randint(0, 8192, (t,), device="cuda")
    ref = qkv.clone()
    for buf, fn in ((qkv, elementwise.rotary_embedding), (ref, reference.rotary_embedding)):
        q, k, _ = buf.split([hq * d, hkv * d, hkv * d], dim=-1)
        fn(pos, q.view(t, hq, d), k.view(t, hkv, d), cos, sin)
    torch.testing.assert_close(qkv, ref, **BF16)
    gu = torch.randn(300, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(elementwise.silu_and_mul(gu), reference.silu_and_mul(gu), **BF16)
