"""SiLU-and-multiply of the fused gate/up projection: Triton kernel, launcher, reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels import pdl
from kiln.kernels._triton import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2*I) laid out [gate | up] -> (T, I) = silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = 0):  # fmt: skip
    pdl.pdl_enter(PDL >= 1, PDL >= 2)  # kiln.kernels.pdl
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # computed in float32, rounded once
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    t, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        x,
        out,
        x.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        **pdl.kwargs(x),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x) and x.stride(-1) == 1:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
