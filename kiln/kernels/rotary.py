"""Rotary position embedding in the half-split (Hugging Face) layout."""

from __future__ import annotations

import torch


def apply_rotary_ref(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hk, D)
    positions: torch.Tensor,  # (T,) int64
    cos_sin: torch.Tensor,  # (max_positions, D) float32: [cos(f) | sin(f)], f = pos * inv_freq
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions; computed in float32, returned in the input dtype."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions]  # (T, D)
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1).unsqueeze(1)  # (T, 1, D)
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1).unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    return rot(q), rot(k)


apply_rotary = apply_rotary_ref
