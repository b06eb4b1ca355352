"""The Llama family: Llama 2, Llama 3/3.1, Mistral, Qwen2 (qkv bias), SmolLM2.
Structure only; every operation comes from ``kiln.layers``."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config import ModelConfig
from kiln.kernels.attention import AttentionMetadata
from kiln.kernels.partials import SplitPartials
from kiln.kernels.wq_f16 import F16Act
from kiln.layers import Attention, Embedding, GatedMLP, LMHead, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.attn = Attention(cfg, rotary, dtype, device)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(h, cfg.intermediate_size, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,  # (T,)
        x: torch.Tensor,  # (T, H)
        residual: torch.Tensor | None,  # (T, H), None before the first layer
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scale: torch.Tensor | None = None,  # (2,) fp8 cache scales of this layer
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        if residual is None:  # first layer: the residual stream starts as the embedding
            residual = x
            x, _ = self.attn_norm(x)
        else:
            x, residual = self.attn_norm(x, residual)
        # o's and down's split-K sums, if left, are added by the next norm
        # (kiln.kernels.partials)
        x = self.attn(positions, x, kv_cache, meta, kv_scale, partials=True)
        x, residual = self.mlp_norm(x, residual)
        return self.mlp(x, partials=True), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, dtype, device) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        tied = self.embed if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) the step's tokens, all sequences flattened
        positions: torch.Tensor,  # (T,)
        kv_caches: list[torch.Tensor],  # one per layer
        meta: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,  # (num_layers, 2) float32: an fp8 cache's
        prev_tokens: torch.Tensor | None = None,  # the tokens input ids -(r + 1) stand for
        head_input: bool = False,
    ) -> torch.Tensor | F16Act:  # (T, H) final hidden states
        """``head_input``: every row goes to ``compute_logits`` as it is (the decode graphs),
        so the final norm may write the float16-code head's prepared input
        (``kiln.kernels.wq_tiled``); other callers index the rows first and get a tensor."""
        x = self.embed(input_ids, prev_tokens)
        residual: torch.Tensor | None = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            scale = None if kv_scales is None else kv_scales[i]
            x, residual = layer(positions, x, residual, cache, meta, scale)
        x, _ = self.norm(x, residual, prepare=head_input)
        return x

    def compute_logits(
        self, hidden: torch.Tensor | F16Act, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # (N, H) -> (N, V) float32, into ``out`` where given
        return self.lm_head(hidden, out)
