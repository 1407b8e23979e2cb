"""Building blocks of a Llama-family decoder on paged KV: RMSNorm, rotary embedding, attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.kernels import ops
from splitserve.kernels.checks import KV_FP8
from splitserve.kernels.quant import QuantizedRows
from splitserve.models.parallel import SINGLE, RowParallelLinear, Shards, TPGroup
from splitserve.models.quantization import make_linear

if TYPE_CHECKING:
    from splitserve.models.config import ModelConfig
    from splitserve.models.quantization import QuantSpec


@dataclass(slots=True)
class AttentionMetadata:
    """How the flat batch of one forward maps onto sequences and KV slots.

    ``T`` tokens of ``B`` sequences; sequence b's new tokens are rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and it has ``seq_lens[b]`` tokens of context after this
    step (cached prefix + new tokens). ``is_decode``: every sequence has exactly one new token.
    ``checked``: the contents were checked on the host when they were built
    (``ModelRunner.prepare``), so the kernels skip their own contents checks: each costs a
    device-to-host sync, which in every layer would stall the launch of the rest of the forward.

    ``num_decodes``: in a step that also computes prompt tokens, the first ``num_decodes``
    sequences have one new token each (``ModelRunner.prepare`` puts them first). They go to the
    decode kernel; the prefill kernel takes the rest, described by ``prompt_part`` (its own
    contiguous block table, lengths and offsets from row ``num_decodes``: slices of this
    metadata's tensors would start at addresses Triton compiles another kernel variant for, in
    the middle of serving). The prefill kernel's query tile is as tall as the longest prompt chunk
    wants (up to 256 rows), so a one-token sequence inside it would compute a whole tile.
    """

    slot_mapping: torch.Tensor  # [T] int64, slot = block_id * block_size + offset (< 0: padding)
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with the null block 0
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    max_query_len: int
    is_decode: bool
    checked: bool = False
    num_decodes: int = 0
    prompt_part: AttentionMetadata | None = None
    last_rows: torch.Tensor | None = None  # [B] int64: each sequence's last row, when reordered


class RMSNorm(nn.Module):
    """``fp8_out``: the output goes to an FP8 linear layer only, so it leaves quantized per token
    (`QuantizedRows`, quantized in the norm's own kernel on GPU)."""

    def __init__(self, hidden_size: int, eps: float, fp8_out: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fp8_out = fp8_out

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | QuantizedRows:
        """Normalise ``x``; with ``residual``, normalise ``x + residual`` and leave that sum in
        ``residual`` (one fused kernel on GPU; transformers' exact arithmetic on CPU)."""
        if self.fp8_out:
            return ops.rms_norm_fp8(x, self.weight, self.eps, residual)
        return ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, indexed per token."""

    cos: torch.Tensor  # [max_positions, head_dim] (registered buffers)
    sin: torch.Tensor

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        # Same arithmetic as transformers' rotary forward (float32 position * inv_freq), so the
        # table rows equal what it computes per position.
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q: [T, Hq, D] and k: [T, Hkv, D] in place."""
        ops.rotary_embedding(positions, q, k, self.cos, self.sin)


class PagedAttention(nn.Module):
    """Self-attention whose K/V live only in the paged pool (fused q/k/v projection).

    Under tensor parallelism (``tp``, models/parallel.py) this rank computes its query heads and
    KV heads only (``shards``): qkv_proj holds their rows, o_proj their columns. ``quant``: the
    projections in FP8 (models/quantization.py)."""

    kv_scales: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        shards: Shards | None = None,
        tp: TPGroup = SINGLE,
        quant: QuantSpec | None = None,
    ) -> None:
        super().__init__()
        shards = shards or Shards.of(config, tp)
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = len(shards.heads), len(shards.kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = make_linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, quant
        )
        self.o_proj = RowParallelLinear(
            self.q_size, config.hidden_size, config.o_bias, tp, fp8=quant is not None
        )
        # An FP8 KV cache's scales (K's, V's): the cache holds k / kv_scales[0], v / kv_scales[1].
        # 1.0 unless the checkpoint has them (``self_attn.k_scale``/``v_scale``: models.loader).
        self.register_buffer("kv_scales", torch.ones(2, dtype=torch.float32), persistent=False)

    def forward(
        self,
        hidden: torch.Tensor | QuantizedRows,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rotary(positions, q, k)
        key_cache, value_cache = kv_cache
        validate = not meta.checked
        scales = self.kv_scales if key_cache.dtype == KV_FP8 else None
        ops.reshape_and_cache(
            k, v, key_cache, value_cache, meta.slot_mapping, validate=validate, kv_scales=scales
        )
        if meta.is_decode:
            out = ops.paged_decode_attention(
                q,
                key_cache,
                value_cache,
                meta.block_table,
                meta.seq_lens,
                self.scale,
                validate=validate,
                kv_scales=scales,
            )
        elif meta.num_decodes and meta.prompt_part is not None:
            nd, rest = meta.num_decodes, meta.prompt_part
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            ops.paged_decode_attention(
                q[:nd],
                key_cache,
                value_cache,
                meta.block_table[:nd],
                meta.seq_lens[:nd],
                self.scale,
                out=out[:nd],
                validate=validate,
                kv_scales=scales,
            )
            ops.paged_prefill_attention(
                q[nd:],
                key_cache,
                value_cache,
                rest.block_table,
                rest.cu_seqlens_q,
                rest.seq_lens,
                self.scale,
                out=out[nd:],
                max_query_len=rest.max_query_len,
                validate=validate,
                kv_scales=scales,
            )
        else:
            out = ops.paged_prefill_attention(
                q,
                key_cache,
                value_cache,
                meta.block_table,
                meta.cu_seqlens_q,
                meta.seq_lens,
                self.scale,
                max_query_len=meta.max_query_len,
                validate=validate,
                kv_scales=scales,
            )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one projection.
    ``intermediate_size``: this rank's share under tensor parallelism (down_proj row-parallel).
    ``quant``: both projections in FP8."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        tp: TPGroup = SINGLE,
        quant: QuantSpec | None = None,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, bias, quant)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, tp, fp8=quant is not None
        )

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.down_proj.weight_scale is not None:  # FP8: quantized in the activation's kernel
            return self.down_proj(ops.silu_and_mul_fp8(gate_up))
        return self.down_proj(ops.silu_and_mul(gate_up))
