from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.activation import silu_and_mul
from kiln.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate, dtype=dtype, device=device)
        self.down = Linear(intermediate, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return self.down(silu_and_mul(self.gate_up(x)))
