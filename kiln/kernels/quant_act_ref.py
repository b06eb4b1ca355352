"""Torch references of the per-token activation quantization (``kiln.kernels.quant_act``,
whose docstring gives the format, outlier columns included): ``QuantAct``, and the
quantization alone or after RMSNorm / SiLU-and-multiply. Every Triton kernel there
reproduces these bit for bit; on the CPU they are what runs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.kernels.activation import silu_and_mul_ref
from kiln.kernels.rmsnorm import rms_norm_ref

KINDS = ("fp8", "int8")
_QMAX = {"fp8": 448.0, "int8": 127.0}
_DTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_TINY = 1e-12  # the scale of an all-zero row is this / qmax (as kiln.quant.formats)


class QuantAct(NamedTuple):
    """A quantized activation: ``q`` (M, K), ``scale`` (M, 1) float32 (per token) or
    (M, K / G) (per token and group of G channels)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device


def quantize_rows_ref(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    group: int | None = None,
    outliers: torch.Tensor | None = None,
) -> QuantAct:
    """(M, K) -> QuantAct: optional ``x / smooth`` (rounded to x's dtype), then symmetric
    quantization per row, or per row and ``group`` consecutive channels (K % group == 0);
    fp8 saturates and rounds to nearest even, int8 rounds half to even and clamps to +-127.
    ``outliers`` (fp8, per row): q gets the 2C columns of the module docstring."""
    if outliers is not None and (kind != "fp8" or group or smooth is not None):
        raise ValueError("outlier channels are split for fp8 per-token quantization only")
    if smooth is not None:
        x = (x.float() / smooth.float()).to(x.dtype)
    m, k = x.shape
    g = group or k
    if k % g:
        raise ValueError(f"group={group} must divide the row length {k}")
    xf = x.float().reshape(m, k // g, g)
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / _QMAX[kind]
    y = (xf / s).reshape(m, k)
    if kind == "fp8":
        v = y.clamp(-448.0, 448.0)
        q = v.to(torch.float8_e4m3fn)
        if outliers is not None:
            hi = q[:, outliers]
            lo = (v[:, outliers] - hi.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            q = torch.cat([q, lo, hi], dim=1)
    else:
        q = torch.round(y).clamp(-127.0, 127.0).to(torch.int8)
    return QuantAct(q, s.reshape(m, k // g))


def rms_norm_quant_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
) -> tuple[QuantAct, torch.Tensor | None]:
    y, r = rms_norm_ref(x, weight, eps, residual)
    return quantize_rows_ref(y, kind, smooth, outliers=outliers), r


def silu_and_mul_quant_ref(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
) -> QuantAct:
    return quantize_rows_ref(silu_and_mul_ref(x), kind, smooth, outliers=outliers)
