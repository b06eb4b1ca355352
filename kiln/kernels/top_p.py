"""Top-p (with min-p) keep-thresholds of whole rows without sorting them: a Triton kernel,
one program per row, that reads its row a few times and allocates nothing beside its
(R,) output. Its torch reference is the sampler's sort path (``kiln.runtime.filters``,
``keep_thresholds`` on rows with top-p and no top-k), which sorts each row; the sampler
takes the kernel on CUDA for ``MIN_ROWS`` such rows or more (``KILN_TOP_P_KERNEL=0``: never).
On an H100 a 256-row decode step of a 2-layer Llama-3.1-8B with top-p 0.9 took 3.65 ms
with it against 6.0 sorted (greedy: 2.58).

Per row r of (N, V) float32 logits ``x`` (``rows`` picks the rows; ``inv_temp``, ``top_p``
and ``min_p`` are (N,) and indexed by row): min-p keeps the tokens with
``x >= max + log(min_p) / inv_temp``; over those, in ``softmax(x * inv_temp)``
renormalized, a token is dropped when the mass of the tokens ranked before it reaches
``top_p``. The threshold is the least value kept, so every token tied with it is kept too:
the sampler keeps ``x >= threshold``.

The kernel finds that value as a search over the values' order. Call ``S(v)`` the kept
mass of the tokens whose value is above ``v``: S falls as v rises, and the threshold is
the least value of the row with ``S(v) < top_p`` (the first of its ties is ranked after
exactly the tokens above it). Each float32 maps to an int32 key in the same order (the
bits, with the negative ones' magnitude bits flipped), and each pass over the row sums S at
``WAYS`` evenly spaced keys of the interval left, which shrinks it ``WAYS``-fold: about
eight passes for 32-bit keys, after the two for the row's max and its softmax sum. The
sums run in another order than the reference's cumulative sum, so where a token's mass
ranked before it is within rounding of ``top_p`` the two may keep one tie group more or
less; elsewhere they agree exactly."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.errors import env_flag
from kiln.kernels._triton import use_triton

__all__ = ["top_p_thresholds_triton", "use_top_p_kernel"]

ENABLED = env_flag(os.environ, "KILN_TOP_P_KERNEL", True)
# below this many rows the sort is faster (an H100, vocab 128,256, the thresholds alone:
# 1 / 16 / 64 / 256 rows sorted 0.39 / 0.58 / 1.30 / 4.25 ms, the kernel 0.89 / 0.89 /
# 0.91 / 2.46: one program reads a whole row, so few rows leave the GPU idle)
MIN_ROWS = 64

# 16 candidate keys a pass; the (BLOCK, WAYS) partial sums in registers (98 a thread at
# 16 warps for sm_90, no spill; 164 at 8 warps)
_BLOCK, _WAYS, _NUM_WARPS = 1024, 16, 16


@triton.jit
def _flip(b):
    """float32 bits (as int32) <-> an int32 key in the values' order (-0.0 just below +0.0):
    the negative ones' magnitude bits flipped, a map that is its own inverse."""
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _key(v):
    return _flip(v.to(tl.int32, bitcast=True))


@triton.jit
def _top_p_kernel(x_ptr, stride, rows_ptr, inv_temp_ptr, top_p_ptr, min_p_ptr, out_ptr,
                  V: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr):  # fmt: skip
    # (V a constant: one compile a vocabulary; Triton's interpreter loops only to one)
    i = tl.program_id(0)
    r = tl.load(rows_ptr + i)
    base = x_ptr + r * stride
    it = tl.load(inv_temp_ptr + r)
    p = tl.load(top_p_ptr + r)
    floor = tl.log(tl.load(min_p_ptr + r)) / it  # -inf when min-p is off
    offs = tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        o = start + offs
        acc = tl.maximum(acc, tl.load(base + o, mask=o < V, other=float("-inf")))
    mx = tl.max(acc, 0)
    cut = mx + floor  # min-p keeps x >= cut
    top = mx * it  # softmax subtracts the scaled row's max
    z = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        o = start + offs
        v = tl.load(base + o, mask=o < V, other=float("-inf"))
        z += tl.where(v >= cut, tl.exp(v * it - top), 0.0)
    target = p * tl.sum(z, 0)
    # keys in (lo, hi]: S(hi) < target (the max: nothing above it), S(lo) >= target
    lo = tl.full((), -(2**31) - 1, tl.int64)
    hi = _key(mx).to(tl.int64)
    j = tl.arange(0, WAYS)
    while hi - lo > 1:
        step = (hi - lo + WAYS - 1) // WAYS
        cand = tl.minimum(lo + step * (j + 1), hi)  # (WAYS,), the last one hi
        c32 = cand.to(tl.int32)
        acc2 = tl.zeros((BLOCK, WAYS), tl.float32)  # summed across threads once a pass
        for start in range(0, V, BLOCK):
            o = start + offs
            v = tl.load(base + o, mask=o < V, other=float("-inf"))
            w = tl.where(v >= cut, tl.exp(v * it - top), 0.0)
            acc2 += tl.where(_key(v)[:, None] > c32[None, :], w[:, None], 0.0)
        s = tl.sum(acc2, 0)
        first = tl.min(tl.where(s < target, j, WAYS - 1), 0)  # hi's S is below target
        new_lo = tl.sum(tl.where(j == first - 1, cand, 0), 0)
        lo = tl.where(first == 0, lo, new_lo)
        hi = tl.sum(tl.where(j == first, cand, 0), 0)
    tl.store(out_ptr + i, _flip(hi.to(tl.int32)).to(tl.float32, bitcast=True))


def top_p_thresholds_triton(
    x: torch.Tensor,
    rows: torch.Tensor,
    inv_temp: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """(R,) thresholds of the rows ``rows`` of x (top-p and min-p as the module says),
    without a sort or any (R, V) temporary: one program per row."""
    assert x.dtype == torch.float32 and x.stride(1) == 1, (x.dtype, x.stride())
    out = torch.empty(rows.shape[0], device=x.device, dtype=torch.float32)
    if rows.numel():
        _top_p_kernel[(rows.shape[0],)](
            x, x.stride(0), rows, inv_temp, top_p, min_p, out, x.shape[1],
            BLOCK=_BLOCK, WAYS=_WAYS, num_warps=_NUM_WARPS,
        )  # fmt: skip
    return out


def use_top_p_kernel(x: torch.Tensor, rows: int) -> bool:
    """Whether ``rows`` rows with top-p and no top-k take the kernel rather than a sort:
    on CUDA, at ``MIN_ROWS`` rows or more, unless ``KILN_TOP_P_KERNEL=0``."""
    return ENABLED and rows >= MIN_ROWS and use_triton(x) and x.stride(-1) == 1
