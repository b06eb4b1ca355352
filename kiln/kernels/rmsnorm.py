"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # (T, H)
    weight: torch.Tensor,  # (H,)
    eps: float,
    residual: torch.Tensor | None = None,  # (T, H), same dtype as x
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(norm(x + residual) * weight, x + residual)``; the sum is taken in x's dtype
    (as transformers does), the normalization in float32."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


rms_norm = rms_norm_ref
