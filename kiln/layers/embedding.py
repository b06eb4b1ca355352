from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.embedding import embed
from kiln.kernels.gemv import linear
from kiln.kernels.wq_f16 import F16Act


class Embedding(nn.Module):
    """Token embedding. weight: (vocab, hidden)."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """(T,) -> (T, H). ``prev``: the previous step's sampled tokens on the device, which
        an id ``-(r + 1)`` stands for (``kiln.kernels.embedding``)."""
        return embed(ids, self.weight, prev)


class LMHead(nn.Module):
    """Output projection to the vocabulary; logits in float32. With ``tied`` set it reads the
    embedding's weight and owns none (the engine then stores the matrix once). ``proj``,
    when a quantization pass sets it (a ``QuantLinear``, ``--quantize-lm-head``), replaces
    the weight: an untied head then holds none of its own."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        tied: Embedding | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._tied = [tied] if tied is not None else None  # a list keeps it out of state_dict
        self.register_module("proj", None)
        if tied is None:
            self.weight = nn.Parameter(
                torch.empty(vocab, hidden, dtype=dtype, device=device), requires_grad=False
            )

    def dense_weight(self) -> torch.Tensor:
        """The unquantized (vocab, hidden) matrix the head multiplies by."""
        return self._tied[0].weight if self._tied else self.weight

    def set_proj(self, proj: nn.Module) -> None:
        """Multiply by ``proj`` from now on; an untied head drops its own weight."""
        self.proj = proj
        if self._tied is None:
            self.weight = None

    def forward(self, h: torch.Tensor | F16Act, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) -> (N, vocab) float32 logits; into ``out`` (an (N, vocab) float32 buffer)
        where given, in place of a new tensor (the CUDA graphs share one). ``h`` prepared
        by the final norm (``F16Act``) only for a ``proj`` stored for it."""
        if self.proj is not None and out is not None and getattr(self.proj, "f16_rows", 0):
            y = self.proj(h, out=out)  # the float16-code kernel may write the logits itself
            return y if y is out else out.copy_(y)
        y = self.proj(h) if self.proj is not None else linear(h, self.dense_weight())
        return y.float() if out is None else out.copy_(y)
