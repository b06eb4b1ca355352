from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm; given ``residual``, adds it first and returns the new residual too."""

    def __init__(
        self,
        hidden: int,
        eps: float,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rms_norm(x, self.weight, self.eps, residual)
