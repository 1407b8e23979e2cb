"""Public paged-KV ops. Model code calls only these.

Each op runs the Triton kernel on CUDA tensors and the plain-torch reference on CPU tensors. All
but the FP8 forms are made by `_dispatch`, one line each, from their reference (`kernels.reference`:
the op's signature and docstring) and the module of the Triton launcher of the same name.
Launchers check shapes, strides and dtypes (ValueError) before anything runs. With
`validate=True` (default) they also check table contents (block ids inside the pool, seq_lens that
fit the block table, slots): one host sync, skipped during CUDA graph capture; pass
`validate=False` where the contents were checked on the host already (the model runner checks
them once per step, in `ModelRunner.prepare`; see `kernels.checks`).

NOTE: the Triton modules are imported on first CUDA use, so CPU-only processes never load Triton.

Shapes (`T` tokens of this step, `B` sequences, `Hq` query heads, `Hkv` KV heads, `D` head_dim):
- `key_cache` / `value_cache`: one layer's views of the pool, `(num_blocks, block_size, Hkv, D)`,
  from `kernels.layout.layer_kv_views`; any block/token/head strides, innermost dim contiguous.
- `block_table`: `[B, max_blocks]` int32 (int64 accepted), physical block ids of each sequence in
  order, padded with the null block 0.
- `seq_lens`: `[B]` int32, context length of each sequence counting every token whose K/V is in the
  cache (for decode: including the current token, already cached by `reshape_and_cache`).
- dtypes: float16/bfloat16 on CUDA; float32 (also 16-bit) on CPU. Query, caches and out share one,
  or the caches are float8_e4m3fn (an FP8 KV cache) with `kv_scales` (float32 [2]: K's scale,
  V's): each value stored is the computed one divided by its scale.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import ParamSpec, TypeVar, cast

import torch

from splitserve.kernels import quant, reference
from splitserve.kernels.quant import QuantizedRows

P = ParamSpec("P")
R = TypeVar("R")

TRITON_MODULES: dict[str, str] = {}
"""Op made by `_dispatch` -> the module of `kernels` with its Triton launcher."""


def _dispatch(reference_op: Callable[P, R], module: str, on: str | None = None) -> Callable[P, R]:
    """The op of `reference_op`'s name, signature and docstring: the launcher of that name in
    `kernels.<module>` (imported on the first CUDA call) where argument `on` (default: the first)
    is a CUDA tensor, `reference_op` otherwise."""
    name = reference_op.__name__
    params = list(inspect.signature(reference_op).parameters)
    on = on or params[0]
    index = params.index(on)
    triton_module: ModuleType | None = None

    def op(*args, **kwargs):
        nonlocal triton_module
        tensor = args[index] if len(args) > index else kwargs.get(on)
        if tensor is None or not tensor.is_cuda:
            return reference_op(*args, **kwargs)
        if triton_module is None:
            triton_module = importlib.import_module(f"{__package__}.{module}")
        return getattr(triton_module, name)(*args, **kwargs)

    functools.update_wrapper(op, reference_op)
    op.__module__ = __name__
    TRITON_MODULES[name] = module
    return cast(Callable[P, R], op)


reshape_and_cache = _dispatch(reference.reshape_and_cache, "cache_write")
paged_decode_attention = _dispatch(reference.paged_decode_attention, "decode_attention")
paged_prefill_attention = _dispatch(reference.paged_prefill_attention, "prefill_attention")
rms_norm = _dispatch(reference.rms_norm, "elementwise")
rotary_embedding = _dispatch(reference.rotary_embedding, "elementwise", on="q")
silu_and_mul = _dispatch(reference.silu_and_mul, "elementwise")


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> QuantizedRows:
    """`rms_norm`, its output quantized per token for an FP8 linear layer: on CUDA in the same
    kernel (the values `quant.quantize_rows` gives for `rms_norm`'s output, one pass less)."""
    if x.is_cuda:
        from splitserve.kernels.elementwise import rms_norm_fp8 as triton_op

        q, scale = triton_op(x, weight, eps, residual, quant.FP8_MAX, quant.MIN_SCALE)
        return QuantizedRows(q, scale, x.dtype)
    return QuantizedRows.of(reference.rms_norm(x, weight, eps, residual))


def silu_and_mul_fp8(gate_up: torch.Tensor) -> QuantizedRows:
    """`silu_and_mul`, quantized per token for an FP8 linear layer: on CUDA one kernel that never
    writes the 16-bit activation (the values `quant.quantize_rows` gives for `silu_and_mul`'s)."""
    if gate_up.is_cuda:
        from splitserve.kernels.elementwise import silu_and_mul_fp8 as triton_op

        q, scale = triton_op(gate_up, quant.FP8_MAX, quant.MIN_SCALE)
        return QuantizedRows(q, scale, gate_up.dtype)
    return QuantizedRows.of(reference.silu_and_mul(gate_up))
