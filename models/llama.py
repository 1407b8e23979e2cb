"""Llama-family decoder (Llama, Qwen2, Mistral) reading and writing K/V only via the paged pool."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from splitserve.kernels.layout import layer_kv_views
from splitserve.models.config import ModelConfig
from splitserve.models.layers import (
    AttentionMetadata,
    GatedMLP,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
)
from splitserve.models.parallel import (
    SINGLE,
    Shards,
    TPGroup,
    VocabParallelEmbedding,
    gather_logits,
)
from splitserve.models.quantization import QuantSpec


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        shards: Shards,
        tp: TPGroup = SINGLE,
        quant: QuantSpec | None = None,
    ) -> None:
        super().__init__()
        # FP8 layers: each norm's output feeds one FP8 projection only, so it leaves quantized.
        fp8 = quant is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp8_out=fp8)
        self.self_attn = PagedAttention(config, layer_idx, shards, tp, quant)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, fp8_out=fp8
        )
        self.mlp = GatedMLP(
            config.hidden_size, len(shards.intermediate), config.mlp_bias, tp, quant
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block. ``residual`` is the running sum of the sub-layer outputs (None before
        the first layer); the next norm adds ``hidden`` into it, fused with the normalisation."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, rotary, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """One forward serves prefill, cached-prefix prefill, chunked prefill and decode alike.

    ``forward(input_ids [T], positions [T], kv_pool, meta)`` returns the final hidden states
    ``[T, hidden]``; ``compute_logits`` turns selected rows into float32 logits.

    ``tp``: this rank's tensor-parallel group (models/parallel.py); the model then holds only
    this rank's shards (``shards``) and its forward takes part in the group's collectives, so
    every rank must run the same forwards in the same order (the runner sees to it).

    ``quant``: the decoder's linear layers in FP8 (models/quantization.py); None: in ``dtype``.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        tp: TPGroup = SINGLE,
        quant: QuantSpec | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.quant = quant
        self.shards = shards = Shards.of(config, tp)
        self.embed_tokens = VocabParallelEmbedding(shards, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, shards, tp, quant) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, len(shards.vocab), bias=False)
        self.rotary = RotaryEmbedding(
            config.hf_config, config.head_dim, config.max_model_len, dtype
        )
        # Called with each layer's index once its forward is queued (its KV written): a prefill
        # node's layer-wise KV stream (engine.layer_stream). Eager forwards only.
        self.layer_done: Callable[[int], None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        layer_done = self.layer_done
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(
                hidden, residual, positions, self.rotary, layer_kv_views(kv_pool, i), meta
            )
            if layer_done is not None:
                layer_done(i)
        return self.norm(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = nn.functional.linear(hidden, weight)
        return gather_logits(logits, self.tp, self.config.vocab_size).float()
