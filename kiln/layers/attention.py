from __future__ import annotations

import os

import torch
from torch import nn

from kiln.config import ModelConfig
from kiln.errors import env_flag
from kiln.kernels.attention import KV_FP8, AttentionMetadata, paged_attention
from kiln.kernels.hadamard import hadamard_signs, kv_rotation_allowed
from kiln.kernels.partials import SplitPartials
from kiln.kernels.rotary import rotary_write_kv
from kiln.kernels.wq_rope import qkv_rotary_kv
from kiln.layers.linear import Linear
from kiln.layers.rotary import RotaryEmbedding

FRESH_PREFILL = env_flag(os.environ, "KILN_FRESH_PREFILL", True)
"""Whole prompts over an fp8 cache attend over their own K/V as computed (0: through the
cache, as before; for A/B measurements)."""


class Attention(nn.Module):
    """Grouped-query self-attention with a fused qkv projection over a paged KV cache."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        self.qkv = Linear(
            cfg.hidden_size,
            cfg.q_size + 2 * cfg.kv_size,
            bias=cfg.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.o = Linear(cfg.q_size, cfg.hidden_size, dtype=dtype, device=device)
        self._rotary = [rotary]  # shared by all layers; a list keeps it out of state_dict
        # (D, D) Hadamard signs when q and k are rotated for an fp8 cache (set_kv_rotation)
        self.kv_rotation: torch.Tensor | None = None

    def forward(
        self,
        positions: torch.Tensor,  # (T,)
        x: torch.Tensor,  # (T, H)
        kv_cache: torch.Tensor,  # (2, num_blocks, tokens_per_block, Hk, D)
        meta: AttentionMetadata,
        kv_scale: torch.Tensor | None = None,  # (2,) float32 (k, v) scales of an fp8 cache
        partials: bool = False,  # o's split-K partials may be returned (kiln.kernels.partials)
    ) -> torch.Tensor | SplitPartials:
        t = x.shape[0]
        # whole prompts over an fp8 cache attend over their keys and values as computed
        # (the kernel leaves the rotated k in qkv), not as the cache rounds them
        fresh = (
            FRESH_PREFILL
            and kv_cache.dtype == KV_FP8
            and meta.fresh_prefill
            and not meta.decode_only
            and bool(meta.split_rows().whole)
        )
        cos_sin = self._rotary[0].cos_sin(x.device)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        q = None
        if not fresh and kv_scale is None and self.kv_rotation is None:
            # one token on the int4 rows kernel: rotary and the cache write in its epilogue
            q = qkv_rotary_kv(self.qkv, x, positions, cos_sin, kv_cache, meta.slot_mapping,
                              *heads)  # fmt: skip
        if q is None:
            qkv = self.qkv(x)
            # rotary on q and k, k and v written to the cache, rotated q returned: one pass
            q, fresh = rotary_write_kv(qkv, positions, cos_sin, kv_cache, meta.slot_mapping,
                                       *heads, kv_scale, self.kv_rotation,
                                       fresh_k=fresh)  # fmt: skip
        fresh_kv = None
        if fresh:
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            v = qkv[:, self.q_size + self.kv_size :]
            fresh_kv = (k.view(t, self.num_kv_heads, self.head_dim),
                        v.view(t, self.num_kv_heads, self.head_dim))  # fmt: skip
        o = paged_attention(
            q, kv_cache, meta, self.scale, self.sliding_window, kv_scale, fresh_kv=fresh_kv
        )
        return self.o(o.reshape(t, self.q_size), partials=partials)


def set_kv_rotation(model: nn.Module, enabled: bool, dtype: torch.dtype) -> bool:
    """Switch the Hadamard rotation of q and k (``kiln.kernels.rotary.rotary_write_kv_ref``)
    in every attention layer of ``model``: on only if ``enabled`` and the head size allows
    it. One (D, D) sign matrix in the activation dtype on the model's device is shared by
    the layers (a static tensor: CUDA graphs capture it). Returns whether it is on."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        return False
    d = layers[0].head_dim
    on = enabled and kv_rotation_allowed(d)
    signs = None
    if on:
        # any tensor of the model says where it lives (quantized projections hold buffers)
        device = next(iter([*model.parameters(), *model.buffers()])).device
        signs = hadamard_signs(d, device, dtype)
    for m in layers:
        m.kv_rotation = signs
    return on
