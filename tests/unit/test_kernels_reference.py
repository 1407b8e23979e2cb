"""The plain-torch references against dumb dense attention, the CPU dispatch, the pool layout
and block transfer, and bad-input errors. No Triton kernel runs here."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from support.paged_kv import make_paged_kv

from splitserve import kernels
from splitserve.kernels import layout, ops, reference

BLOCK_SIZE = 16
# Reference math is float32; the dense check is float64 on the same float32 inputs.
REF_ATOL = 1e-5
REF_RTOL = 1e-5
EDGE_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5]


@pytest.fixture
def gen(rng) -> torch.Generator:
    """A seed per test (tests/conftest.py), printed on failure by pytest's captured output."""
    seed = rng.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def dense_attention(q, k, v, scale, q_pos):
    """q [M, Hq, D], k/v [N, Hkv, D]; query m attends keys 0..q_pos[m]. float64, head by head."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for m in range(q.shape[0]):
            scores = (kh @ q[m, h].double()) * scale
            scores[q_pos[m] + 1 :] = float("-inf")
            out[m, h] = torch.softmax(scores, 0) @ vh
    return out


@pytest.mark.parametrize("heads", [(4, 4, 32), (8, 2, 64), (6, 2, 16)])
def test_decode_reference_matches_dense(gen, heads):
    hq, hkv, d = heads
    kv = make_paged_kv(EDGE_LENS, hkv, d, BLOCK_SIZE, torch.float32, "cpu", gen)
    q = torch.randn(len(EDGE_LENS), hq, d, generator=gen)
    out = torch.full_like(q, float("nan"))
    reference.paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, kv.seq_lens, d**-0.5, out=out
    )
    for b, n in enumerate(EDGE_LENS):
        want = dense_attention(q[b : b + 1], kv.keys[b], kv.values[b], d**-0.5, [n - 1])
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=REF_ATOL, rtol=REF_RTOL)


def test_prefill_reference_matches_dense(gen):
    hq, hkv, d = 8, 2, 32
    # (context, new tokens): fresh prompts and prompts whose prefix is already cached.
    shapes = [(1, 1), (15, 15), (16, 16), (17, 17), (40, 7), (33, 1), (20, 0)]
    kv = make_paged_kv([c for c, _ in shapes], hkv, d, BLOCK_SIZE, torch.float32, "cpu", gen)
    q_lens = [n for _, n in shapes]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen)
    out = reference.paged_prefill_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, cu, kv.seq_lens, d**-0.5
    )
    for b, (ctx, n) in enumerate(shapes):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = dense_attention(
            q[rows], kv.keys[b], kv.values[b], d**-0.5, list(range(ctx - n, ctx))
        )
        torch.testing.assert_close(out[rows].double(), want, atol=REF_ATOL, rtol=REF_RTOL)


def test_reshape_and_cache_reference_writes_only_its_slots(gen):
    kv = make_paged_kv([BLOCK_SIZE + 3, 5], 2, 16, BLOCK_SIZE, torch.float32, "cpu", gen)
    before = kv.kv_pool.clone()
    num_slots = kv.key_cache.shape[0] * BLOCK_SIZE
    free = [
        s
        for s in range(BLOCK_SIZE, num_slots)
        if torch.isnan(kv.key_cache.reshape(num_slots, -1)[s]).all()
    ]
    pick = torch.randperm(len(free), generator=gen)[:6].tolist()
    slots = torch.tensor([*(free[i] for i in pick), -1, -1])
    slots = slots[torch.randperm(len(slots), generator=gen)]
    k, v = (torch.randn(len(slots), 2, 16, generator=gen) for _ in range(2))
    ops.reshape_and_cache(k, v, kv.key_cache, kv.value_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kv.key_cache[s // BLOCK_SIZE, s % BLOCK_SIZE], k[t])
            assert torch.equal(kv.value_cache[s // BLOCK_SIZE, s % BLOCK_SIZE], v[t])
    changed = ~((kv.kv_pool == before) | (kv.kv_pool.isnan() & before.isnan()))
    assert int(changed.sum()) == 2 * int((slots >= 0).sum()) * 2 * 16


def test_ops_dispatch_to_reference_on_cpu(gen, monkeypatch):
    from splitserve.kernels import cache_write, decode_attention, prefill_attention

    def boom(*args, **kwargs):
        raise AssertionError("the Triton launcher must not run on CPU tensors")

    monkeypatch.setattr(decode_attention, "paged_decode_attention", boom)
    monkeypatch.setattr(prefill_attention, "paged_prefill_attention", boom)
    monkeypatch.setattr(cache_write, "reshape_and_cache", boom)
    kv = make_paged_kv([5, 17], 2, 16, BLOCK_SIZE, torch.float32, "cpu", gen)
    q = torch.randn(2, 4, 16, generator=gen)
    got = kernels.paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, kv.seq_lens, 0.25
    )
    want = reference.paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, kv.seq_lens, 0.25
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    qp = torch.randn(5, 4, 16, generator=gen)
    got = kernels.paged_prefill_attention(
        qp, kv.key_cache, kv.value_cache, kv.block_table, cu, kv.seq_lens, 0.25
    )
    assert not got.isnan().any()
    kernels.reshape_and_cache(
        qp[:, :2], qp[:, 2:], kv.key_cache, kv.value_cache, torch.full((5,), -1)
    )


class _OnCuda:
    """Stands in for a CUDA tensor: an op reads only `is_cuda` before handing it on."""

    is_cuda = True


def test_ops_dispatch_to_triton_on_cuda(monkeypatch):
    for name, module in ops.TRITON_MODULES.items():
        calls = []
        monkeypatch.setattr(
            importlib.import_module(f"splitserve.kernels.{module}"),
            name,
            lambda *args, calls=calls, **kwargs: calls.append((args, kwargs)) or "launched",
        )
        params = inspect.signature(getattr(reference, name)).parameters
        args = tuple(_OnCuda() for p in params.values() if p.default is p.empty)
        kwargs = dict(zip(params, args, strict=False))
        assert getattr(ops, name)(*args) == "launched"
        assert getattr(ops, name)(**kwargs) == "launched"
        assert calls == [(args, {}), ((), kwargs)], name


def test_triton_launchers_take_their_references_parameters():
    for name, module in ops.TRITON_MODULES.items():
        launcher = getattr(importlib.import_module(f"splitserve.kernels.{module}"), name)
        launcher_params = inspect.signature(launcher).parameters
        for param in inspect.signature(getattr(reference, name)).parameters.values():
            got = launcher_params.get(param.name)
            assert got is not None and (got.kind, got.default) == (param.kind, param.default), (
                f"{module}.{name}: {got} for the reference's {param}"
            )
        assert getattr(ops, name).__doc__ == getattr(reference, name).__doc__


# ---------------------------------------------------------------- layout and block transfer


def test_layer_views_alias_the_block_major_pool():
    pool = layout.allocate_kv_pool(5, 3, 16, 2, 8, torch.float32, "cpu")
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(pool.shape))
    k, v = layout.layer_kv_views(pool, 2)
    assert k.shape == v.shape == (5, 16, 2, 8)
    assert not k.is_contiguous() and k.stride()[1:] == (16, 8, 1)
    assert k.stride(0) == 3 * 2 * 16 * 2 * 8
    assert torch.equal(k[4], pool[4, 2, 0]) and torch.equal(v[1], pool[1, 2, 1])
    k[3, 7, 1, 5] = -1.0
    assert pool[3, 2, 0, 7, 1, 5] == -1.0
    # one block over all layers is one contiguous slice
    assert pool[3].is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_scatter_blocks_byte_exact(gen, dtype):
    src = layout.allocate_kv_pool(12, 2, 16, 2, 8, dtype, "cpu")
    bits = src.view(torch.int16) if dtype != torch.float32 else src.view(torch.int32)
    bits.copy_(torch.randint(-(2**15), 2**15, bits.shape, generator=gen, dtype=bits.dtype))
    ids = torch.tensor([7, 2, 9, 3, 11], dtype=torch.int32)  # shuffled, gaps
    buf = layout.gather_blocks(src, ids)
    assert buf.is_contiguous() and buf.shape == (5, *src.shape[1:])
    dst = layout.allocate_kv_pool(12, 2, 16, 2, 8, dtype, "cpu")
    dst.view(torch.uint8).fill_(0xAB)
    targets = torch.tensor([1, 10, 4, 8, 5])
    layout.scatter_blocks(dst, targets, buf)
    for s, t in zip(ids.tolist(), targets.tolist(), strict=True):
        assert torch.equal(dst[t].view(torch.uint8), src[s].view(torch.uint8))
    untouched = sorted(set(range(12)) - set(targets.tolist()))
    assert (dst[untouched].view(torch.uint8) == 0xAB).all()
    staging = torch.empty_like(buf)
    assert layout.gather_blocks(src, ids, out=staging) is staging
    assert torch.equal(staging.view(torch.uint8), buf.view(torch.uint8))


def test_block_transfer_rejects_bad_ids():
    pool = layout.allocate_kv_pool(4, 1, 16, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"must be in \[0, 4\)"):
        layout.gather_blocks(pool, torch.tensor([1, 4]))
    buf = torch.zeros(2, *pool.shape[1:])
    with pytest.raises(ValueError, match="null block"):
        layout.scatter_blocks(pool, torch.tensor([0, 1]), buf)
    with pytest.raises(ValueError, match="distinct"):
        layout.scatter_blocks(pool, torch.tensor([2, 2]), buf)
    with pytest.raises(ValueError, match="shape"):
        layout.scatter_blocks(pool, torch.tensor([2]), buf)
    with pytest.raises(ValueError, match="multiple of 16"):
        layout.allocate_kv_pool(4, 1, 8, 1, 8, torch.float32, "cpu")


# ---------------------------------------------------------------- bad input


def _decode_args(gen):
    kv = make_paged_kv([5, 20], 2, 16, BLOCK_SIZE, torch.float32, "cpu", gen)
    q = torch.randn(2, 4, 16, generator=gen)
    return q, kv


@pytest.mark.parametrize("op", [reference.paged_decode_attention, ops.paged_decode_attention])
def test_decode_bad_input_is_a_clear_error(gen, op):
    q, kv = _decode_args(gen)
    args = (kv.key_cache, kv.value_cache)
    with pytest.raises(ValueError, match="dtype"):
        op(q.half(), *args, kv.block_table, kv.seq_lens, 0.25)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        op(torch.randn(2, 3, 16), *args, kv.block_table, kv.seq_lens, 0.25)
    with pytest.raises(ValueError, match="too short"):
        op(q, *args, kv.block_table[:, :1], kv.seq_lens, 0.25)
    bad = kv.block_table.clone()
    bad[1, 0] = kv.key_cache.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        op(q, *args, bad, kv.seq_lens, 0.25)
    with pytest.raises(ValueError, match="int32 or int64"):
        op(q, *args, kv.block_table.float(), kv.seq_lens, 0.25)
    with pytest.raises(ValueError, match="seq_lens must be >= 1"):
        op(q, *args, kv.block_table, torch.zeros_like(kv.seq_lens), 0.25)
    with pytest.raises(ValueError, match="scale"):
        op(q, *args, kv.block_table, kv.seq_lens, -1.0)


@pytest.mark.parametrize("op", [reference.paged_prefill_attention, ops.paged_prefill_attention])
def test_prefill_bad_input_is_a_clear_error(gen, op):
    _, kv = _decode_args(gen)
    args = (kv.key_cache, kv.value_cache, kv.block_table)
    qp = torch.randn(7, 4, 16, generator=gen)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="rise from 0"):
        op(qp, *args, torch.tensor([0, 3, 6], dtype=torch.int32), kv.seq_lens, 0.25)
    with pytest.raises(ValueError, match="at least the number of new query tokens"):
        op(qp, *args, cu, torch.tensor([2, 20], dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match="head_dim"):
        op(torch.randn(7, 4, 8), *args, cu, kv.seq_lens, 0.25)


def test_reshape_and_cache_bad_input_is_a_clear_error(gen):
    _, kv = _decode_args(gen)
    k = torch.randn(3, 2, 16, generator=gen)
    caches = (kv.key_cache, kv.value_cache)
    with pytest.raises(ValueError, match="slots >="):
        ops.reshape_and_cache(k, k, *caches, torch.tensor([20, -1, 10**6]))
    with pytest.raises(ValueError, match="null block"):
        ops.reshape_and_cache(k, k, *caches, torch.tensor([3, -1, 40]))
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\]"):
        ops.reshape_and_cache(k[:, :1], k[:, :1], *caches, torch.tensor([20, -1, 40]))
