"""Fused per-token Triton kernels (RMSNorm + residual, rotary, SiLU-and-mul) under
TRITON_INTERPRET=1 against their torch references, which CPU model runs use."""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.kernels import elementwise, reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it when "
    "unset); the compiled kernels run in tests/gpu/",
)

# float32: the kernel sums in another order than torch's mean; float16: the reference rounds
# rotary's two products to float16 separately, the kernel once.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 100, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, n, with_residual):
    t = 7
    x = torch.randn(t, n).to(dtype)
    weight = (torch.rand(n) + 0.5).to(dtype)
    res = torch.randn(t, n).to(dtype) if with_residual else None
    res_ref = res.clone() if with_residual else None
    out = elementwise.rms_norm(x, weight, 1e-6, res)
    ref = reference.rms_norm(x, weight, 1e-6, res_ref)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if with_residual:
        torch.testing.assert_close(res, res_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 64), (8, 1, 32), (3, 3, 16)])
def test_rotary_in_place_on_fused_qkv_views(dtype, hq, hkv, d):
    t, max_pos = 9, 50
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(max_pos).float()[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    positions = torch.randint(0, max_pos, (t,))
    expected = qkv.clone()

    def views(buf):
        q, k, v = buf.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(t, hq, d), k.view(t, hkv, d), v

    reference.rotary_embedding(positions, *views(expected)[:2], cos, sin)
    elementwise.rotary_embedding(positions, *views(qkv)[:2], cos, sin)
    torch.testing.assert_close(qkv, expected, **TOL[dtype])
    assert torch.equal(views(qkv)[2], views(expected)[2])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 1500])
def test_silu_and_mul(dtype, n):
    gate_up = torch.randn(5, 2 * n).to(dtype)
    torch.testing.assert_close(
        elementwise.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **TOL[dtype]
    )


def test_bad_shapes_raise_before_launch():
    with pytest.raises(ValueError, match="rms_norm"):
        elementwise.rms_norm(torch.randn(4, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        elementwise.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-6, torch.randn(3, 8))
    with pytest.raises(ValueError, match="silu_and_mul"):
        elementwise.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="rotary"):
        elementwise.rotary_embedding(
            torch.zeros(2, dtype=torch.long),
            torch.randn(2, 2, 8),
            torch.randn(3, 2, 8),
            torch.randn(4, 8),
            torch.randn(4, 8),
        )
