"""SiLU-and-multiply of the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2*I) laid out [gate | up] -> (T, I) = silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


silu_and_mul = silu_and_mul_ref
