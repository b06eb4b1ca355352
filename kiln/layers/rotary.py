"""Rotary embedding tables: default, linear, llama3 (Llama 3.1) and GGUF per-dimension
frequency factors."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kiln.kernels.rotary import apply_rotary


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, after the checkpoint's scaling rule."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":  # GGUF stores Llama 3.1's rule precomputed as divisors
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unknown rope_type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Holds the (max_positions, head_dim) [cos | sin] float32 table; built on first use on
    the device of the inputs, so it costs nothing in the engine files."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)
        self._cos_sin: torch.Tensor | None = None

    def cos_sin(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = torch.outer(pos, self.inv_freq.to(device))  # (P, D/2)
            self._cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        return self._cos_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, positions, self.cos_sin(q.device))
