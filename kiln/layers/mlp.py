from __future__ import annotations

import torch
from torch import nn

from kiln.kernels import wq_tiled
from kiln.kernels.activation import silu_and_mul
from kiln.kernels.partials import SplitPartials
from kiln.kernels.quant_act import silu_and_mul_quant
from kiln.kernels.wq_f16 import F16Act
from kiln.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one projection. When
    ``fuse_down_quant`` is on (a ``QuantLinear`` down projection with dynamic activation
    quantization), SiLU-mul emits down's quantized input directly; likewise down's prepared
    input when it is a float16-code int4 projection at the step's row count
    (``kiln.kernels.wq_tiled``)."""

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
        self.fuse_down_quant = False

    def forward(
        self, x: torch.Tensor | F16Act, partials: bool = False
    ) -> torch.Tensor | SplitPartials:
        """(T, H) -> (T, H); with ``partials`` the output may be down's split-K partials
        (``kiln.kernels.partials``: for a consumer that adds them itself)."""
        if wq_tiled.wants_f16(self.down, x.shape[0]):
            gu = self.gate_up(x, partials=True)
            return self.down(wq_tiled.silu_mul_f16(gu), partials=partials)
        if self.fuse_down_quant:
            return self.down(silu_and_mul_quant(self.gate_up(x), *self.down.act_quant_args))
        return self.down(silu_and_mul(self.gate_up(x, partials=True)), partials=partials)
