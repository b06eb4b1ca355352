"""RMSNorm, optionally fused with the residual add that precedes it: Triton kernel, its
launcher, the torch reference, and the dispatcher the layers call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import pdl
from kiln.kernels._triton import use_triton
from kiln.kernels.partials import SplitPartials, buffer, finished


def rms_norm_ref(
    x: torch.Tensor,  # (T, H)
    weight: torch.Tensor,  # (H,)
    eps: float,
    residual: torch.Tensor | None = None,  # (T, H), same dtype as x
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(norm(x + residual) * weight, x + residual)``; the sum is taken in x's dtype
    (as transformers does), the normalization in float32."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    r_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    stride_s,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
    SPLIT: tl.constexpr = 0,
):
    pdl.pdl_enter(PDL >= 1, False)  # kiln.kernels.pdl: let the next grid launch
    row = tl.program_id(0)  # one program per token
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    # the weight is no kernel's output: its load goes before the wait, off the step's
    # critical path (no gain measured on an H100: it is likely an L2 hit either way)
    w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    pdl.pdl_enter(False, PDL >= 2)  # then wait for the grid before
    if SPLIT == 0:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    else:  # split-K partials (kiln.kernels.partials): summed in split order, then rounded
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(x_ptr + s * stride_s + row * stride_x + offs, mask=mask, other=0.0)
        x = acc.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # torch's rounding of x + r
        tl.store(r_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    # round the normalized value to x's dtype first, as the reference does, then scale
    y = (xf * inv).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor | SplitPartials,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``rms_norm_ref``; rows must be contiguous in their last dim. ``x``
    may be split-K partials (summed here as ``split_k_reduce`` would)."""
    src, split = buffer(x)
    t, h = x.shape
    out = torch.empty(t, h, dtype=x.dtype, device=src.device)
    r_out = torch.empty_like(out) if residual is not None else None
    r = residual if residual is not None else out
    ro = r_out if r_out is not None else out
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(t,)](
        src,
        r,
        weight,
        out,
        ro,
        src.stride(-2),
        r.stride(0),
        out.stride(0),
        ro.stride(0),
        h,
        eps,
        src.stride(0) if split else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        SPLIT=split,
        **pdl.kwargs(out),  # rows first: the step's tokens (partials put the split first)
        num_warps=min(16, max(1, block // 256)),
    )
    return out, r_out


def rms_norm(
    x: torch.Tensor | SplitPartials,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    src, _ = buffer(x)
    if use_triton(src) and src.stride(-1) == 1:
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(finished(x), weight, eps, residual)
