from __future__ import annotations

import torch
from torch import nn

from kiln.kernels import wq_tiled
from kiln.kernels.partials import SplitPartials, finished
from kiln.kernels.quant_act import QuantAct, rms_norm_quant
from kiln.kernels.rmsnorm import rms_norm
from kiln.kernels.wq_f16 import F16Act


class RMSNorm(nn.Module):
    """RMSNorm; given ``residual``, adds it first and returns the new residual too. With a
    consumer set (``quantize_output_for``), the output is that consumer's per-token
    quantized input (a ``QuantAct``), produced in the same kernel; with a float16-code int4
    consumer (``prepare_output_for``), its prepared input (an ``F16Act``) at the steps
    whose row count it takes (``kiln.kernels.wq_tiled``)."""

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
        self._f16: list[nn.Module] = []
        self.weight = nn.Parameter(
            torch.empty(hidden, dtype=dtype, device=device), requires_grad=False
        )

    def quantize_output_for(self, consumer: nn.Module | None) -> None:
        """Quantize the output for ``consumer`` (a module with ``act_quant_args``, i.e. a
        ``QuantLinear``), or stop doing so (None)."""
        self._consumer[:] = [consumer] if consumer is not None else []

    def prepare_output_for(self, consumer: nn.Module | None) -> None:
        """Write the output as ``consumer``'s float16-code input (a ``QuantLinear`` with
        ``f16_rows``) at steps of at most that many rows, or stop doing so (None)."""
        self._f16[:] = [consumer] if consumer is not None else []

    def forward(
        self,
        x: torch.Tensor | SplitPartials,
        residual: torch.Tensor | None = None,
        prepare: bool = True,
    ) -> tuple[torch.Tensor | QuantAct | F16Act, torch.Tensor | None]:
        """``x`` may be a projection's split-K partials (``kiln.kernels.partials``).
        ``prepare`` False: a plain tensor even where ``prepare_output_for`` is set (a
        caller that indexes the rows first)."""
        if prepare and self._f16 and wq_tiled.wants_f16(self._f16[0], x.shape[0]):
            return wq_tiled.rms_norm_f16(x, self.weight, self.eps, residual)
        if self._consumer:
            c = self._consumer[0]
            return rms_norm_quant(finished(x), self.weight, self.eps, residual, *c.act_quant_args)
        return rms_norm(x, self.weight, self.eps, residual)
