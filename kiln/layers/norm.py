from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.partials import SplitPartials, finished
from kiln.kernels.quant_act import QuantAct, rms_norm_quant
from kiln.kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm; given ``residual``, adds it first and returns the new residual too. With a
    consumer set (``quantize_output_for``), the output is that consumer's per-token
    quantized input (a ``QuantAct``), produced in the same kernel."""

    def __init__(
        self,
        hidden: int,
        eps: float,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self._consumer: list[nn.Module] = []  # a list keeps it out of state_dict / children
        self.weight = nn.Parameter(
            torch.empty(hidden, dtype=dtype, device=device), requires_grad=False
        )

    def quantize_output_for(self, consumer: nn.Module | None) -> None:
        """Quantize the output for ``consumer`` (a module with ``act_quant_args``, i.e. a
        ``QuantLinear``), or stop doing so (None)."""
        self._consumer[:] = [consumer] if consumer is not None else []

    def forward(
        self, x: torch.Tensor | SplitPartials, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | QuantAct, torch.Tensor | None]:
        """``x`` may be a projection's split-K partials (``kiln.kernels.partials``)."""
        if self._consumer:
            c = self._consumer[0]
            return rms_norm_quant(finished(x), self.weight, self.eps, residual, *c.act_quant_args)
        return rms_norm(x, self.weight, self.eps, residual)
