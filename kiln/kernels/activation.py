"""SiLU-and-multiply of the fused gate/up projection: Triton kernel, launcher, reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels import pdl
from kiln.kernels._triton import use_triton
from kiln.kernels.partials import SplitPartials, buffer, finished


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2*I) laid out [gate | up] -> (T, I) = silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, stride_s, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = 0, SPLIT: tl.constexpr = 0):  # fmt: skip
    pdl.pdl_enter(PDL >= 1, PDL >= 2)  # kiln.kernels.pdl
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    if SPLIT == 0:
        g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    else:  # split-K partials (kiln.kernels.partials): summed in split order, then rounded
        g = tl.zeros((BLOCK,), dtype=tl.float32)
        u = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            base = x_ptr + s * stride_s + row * stride_x
            g += tl.load(base + offs, mask=mask, other=0.0)
            u += tl.load(base + inter + offs, mask=mask, other=0.0)
        g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # computed in float32, rounded once
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor | SplitPartials) -> torch.Tensor:
    """``x``: (T, 2I), or its split-K partials (summed here as ``split_k_reduce`` would)."""
    src, split = buffer(x)
    t, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=x.dtype, device=src.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        src,
        out,
        src.stride(-2),
        out.stride(0),
        inter,
        src.stride(0) if split else 0,
        BLOCK=block,
        SPLIT=split,
        **pdl.kwargs(out),  # rows first: the step's tokens (partials put the split first)
    )
    return out


def silu_and_mul(x: torch.Tensor | SplitPartials) -> torch.Tensor:
    src, _ = buffer(x)
    if use_triton(src) and src.stride(-1) == 1:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(finished(x))
