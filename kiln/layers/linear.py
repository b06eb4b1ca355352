"""Linear projections. Fused projections (qkv, gate_up) are one ``Linear`` whose output is
the concatenation of its parts; the builder concatenates the checkpoint's weights."""

from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.gemv import linear


class Linear(nn.Module):
    """y = x W^T (+ b). weight: (out_features, in_features). Decode steps of a few tokens on
    CUDA run the skinny Triton kernel (kiln/kernels/gemv.py); the rest is ``F.linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor:
        """(T, in) -> (T, out); ``partials`` (a consumer that could add split-K partials) is
        for quantized projections (``QuantLinear``): this one always finishes its sums."""
        return linear(x, self.weight, self.bias)
