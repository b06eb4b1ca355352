"""x prepared for the float16-code int4 kernel (``kiln.kernels.wq_f16``): the layout, its
torch reference, and SiLU·mul and RMSNorm writing it directly (Triton), the producers of
the tile-major projections' x (``kiln.kernels.wq_tiled``).

The kernel turns int4 codes into float16 ``1024 + q`` (even codes) and ``1024 + 16 q``
(odd codes) without shifting nibbles, so x is stored to match, per 128-value chunk and
token:

- divided by the chunk's multiplier ``mult`` (below), each odd value divided by 16 more
  (both exact in float32: powers of two), then rounded to float16 once;
- within each word's eight values (one 32-bit word of codes) in the order the ``mma``
  fragments take them, ``ORDER``: values 0, 4, 1, 5, 2, 6, 3, 7 (the odd ones divided);
- with ``sums[chunk, token]`` (float32, eight token slots) holding the float32 sum of the
  stored even values, that of the stored (divided) odd values, ``mult``, and zero. The
  sums take the zero point and the codes' 1024 off after the chunk's ``mma`` steps, and
  ``mult`` scales the chunk's result back: ``mult * (acc - (1024 + z) se - (1024 + 16 z)
  so)``. Token slots past the step's tokens are not written by the kernels (``prep_ref``
  fills them with zeros) and not read for stored outputs.

The range guard: float16 holds up to 65,504, activations may exceed it. ``mult`` is
``2**e`` for the smallest integer ``e >= 0`` with ``max |y| <= 16384 * 2**e`` over the
chunk's 128 real values (``GUARD``), so 1.0 but for chunks with a value above 16,384 and
the stored values stay within 16,384 (odd ones 1,024). A chunk with an infinite or NaN
value gets ``mult`` 1.0: its values are stored as they are (infinite or NaN)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import pdl
from kiln.kernels.partials import SplitPartials, buffer, finished

ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Position p of a word's eight prepared values holds value ``ORDER[p]``."""
CHUNK = 128
MAX_TOKENS = 8
SLICE = 1024  # values a program of the RMSNorm producer writes
NORM_WARPS = 8  # its warps: 1.67 µs a call against 1.98 with 4 (H200, one row of 4,096)
SILU_BLOCK = 128  # values a program of the SiLU·mul producer takes, and its warps:
SILU_WARPS = 1  # 0.88 µs against 1.18 at 1,024 / 4 (H200, one row of 2 x 14,336)
GUARD = 16384.0
"""The largest magnitude stored (a power of two): a chunk's values are divided by the
smallest power of two that brings them within it."""


def guard_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The guard's ``e`` (int32) for each chunk's float32 ``max |y|``: the smallest integer
    ``e >= 0`` with ``amax <= 16384 * 2**e``; 0 where amax is infinite or NaN. Exact:
    ``frexp`` gives ``amax / 16384 = f * 2**x`` with ``0.5 <= f < 1``, which is at most
    ``2**x`` and, for f exactly 0.5, at most ``2**(x - 1)``."""
    f, x = torch.frexp(amax.float() / GUARD)  # exact but where tiny (e = 0 there anyway)
    e = (x - (f == 0.5).to(x.dtype)).clamp_min(0).to(torch.int32)
    return torch.where(torch.isfinite(amax), e, 0)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` in float32 for integer ``-126 <= e <= 127``, built from its bits."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def prep_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M <= 8, K) real values (K a multiple of 128) -> (xq (M, K / 2) int32 of float16
    pairs, sums (K / 128, 8, 4) float32, token slots past M zero)."""
    m, k = x.shape
    if m > MAX_TOKENS or k % CHUNK:
        raise ValueError(f"x of shape {tuple(x.shape)}: at most 8 rows, K a multiple of 128")
    y = x.float().view(m, k // CHUNK, CHUNK)
    e = guard_exponent(y.abs().amax(-1))  # (M, K / 128)
    odd = (torch.arange(CHUNK, device=x.device) % 2).to(torch.int32)
    v = (y / _pow2(e[..., None] + 4 * odd)).to(torch.float16)  # one rounding
    xq = v.view(m, k // 8, 8)[..., list(ORDER)].contiguous().view(m, k).view(torch.int32)
    sums = torch.zeros(k // CHUNK, MAX_TOKENS, 4, dtype=torch.float32, device=x.device)
    c = v.float().view(m, k // CHUNK, CHUNK // 2, 2)
    sums[:, :m, 0] = c[..., 0].sum(-1).T
    sums[:, :m, 1] = c[..., 1].sum(-1).T
    sums[:, :m, 2] = _pow2(e).T
    return xq, sums


def unprep_ref(xq: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """``prep_ref``'s (xq, sums) back to (M, K) float32 real values in natural order, the
    odd ones still divided by 16 (each chunk's values times its ``mult``)."""
    m = xq.shape[0]
    v = xq.contiguous().view(torch.float16).view(m, -1, 8).float()
    out = torch.empty_like(v)
    out[..., list(ORDER)] = v
    mult = sums[:, :m, 2].T  # (M, K / 128)
    return (out.view(m, -1, CHUNK) * mult[..., None]).view(m, -1)


@triton.jit
def _store_prepared(y, offs, mask, q_ptr, sum_ptr, row, chunk, cmask):
    """Write y ((C, 128) float32, whole chunks ``chunk`` of token ``row``, at ``offs`` of
    the row) in the layout: xq to ``q_ptr`` (the row's float16 values), the chunks' sums,
    mult and zero to ``sum_ptr`` ((chunks, 8, 4) float32). Masked chunks are computed but
    not stored; their lanes need not be finite."""
    # max |y| per chunk on the bits: non-negative floats order as integers, and an
    # infinite or NaN value (biased exponent 255) wins, as torch's amax propagates it
    bits = tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    ex = bits >> 23
    # amax = (1 + frac 2**-23) 2**(ex - 127) is at most 2**(14 + e) from e = ex - 141
    # if frac is zero, else from ex - 140; subnormal amax: below, e = 0
    e = tl.maximum(ex - 141 + ((bits & 0x7FFFFF) != 0).to(tl.int32), 0)
    e = tl.where(ex == 255, 0, e)  # not finite: stored as it is
    code = offs % 8
    odd = (code % 2) == 1
    # 2**-(e + 4) for odd values, 2**-e for even ones, from their bits: exact products
    inv = tl.where(odd, (123 - e)[:, None] << 23, (127 - e)[:, None] << 23)
    v = (y * inv.to(tl.float32, bitcast=True)).to(tl.float16)
    # value `code` = 4 e + 2 h + b of a word goes to position 4 h + 2 b + e (ORDER inverted)
    pos = offs - code + ((code // 2) % 2) * 4 + (code % 2) * 2 + code // 4
    tl.store(q_ptr + pos, v, mask=mask)
    vf = v.to(tl.float32)
    se = tl.sum(tl.where(odd, 0.0, vf), axis=1)
    so = tl.sum(tl.where(odd, vf, 0.0), axis=1)
    mult = ((e + 127) << 23).to(tl.float32, bitcast=True)
    base = sum_ptr + chunk * 32 + row * 4
    tl.store(base, se, mask=cmask)
    tl.store(base + 1, so, mask=cmask)
    tl.store(base + 2, mult, mask=cmask)
    tl.store(base + 3, tl.zeros_like(se), mask=cmask)


@triton.jit
def _silu_mul_prep_kernel(x_ptr, xq_ptr, sum_ptr, stride_x, stride_q, inter, stride_s,
                          BLOCK: tl.constexpr, SPLIT: tl.constexpr = 0,
                          ROUND: tl.constexpr = 0, PDL: tl.constexpr = 0):  # fmt: skip
    pdl.pdl_enter(PDL >= 1, PDL >= 2)  # kiln.kernels.pdl
    row = tl.program_id(0)
    chunk = tl.program_id(1) * (BLOCK // 128) + tl.arange(0, BLOCK // 128)
    offs = chunk[:, None] * 128 + tl.arange(0, 128)[None, :]  # (chunks, 128)
    mask = offs < inter  # whole chunks: inter is a multiple of 128, BLOCK too
    if SPLIT == 0:
        g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    else:  # split-K partials (kiln.kernels.partials), summed in split order, then rounded
        g = tl.zeros((BLOCK // 128, 128), dtype=tl.float32)
        u = tl.zeros((BLOCK // 128, 128), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            base = x_ptr + s * stride_s + row * stride_x
            g += tl.load(base + offs, mask=mask, other=0.0)
            u += tl.load(base + inter + offs, mask=mask, other=0.0)
        if ROUND == 1:  # the partials' output dtype: bfloat16
            g = g.to(tl.bfloat16).to(tl.float32)
            u = u.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:  # float16
            g = g.to(tl.float16).to(tl.float32)
            u = u.to(tl.float16).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # as _silu_mul_kernel, in float32
    _store_prepared(y, offs, mask, xq_ptr + row * stride_q, sum_ptr, row, chunk,
                    chunk * 128 < inter)  # fmt: skip


def silu_mul_prep_triton(
    x: torch.Tensor | SplitPartials, block: int | None = None, num_warps: int = SILU_WARPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU·mul of (M <= 8, 2I) [gate | up] (or its split-K partials), written as the
    float16-code kernel's x: ``prep_ref``'s (xq, sums) of ``silu(gate) * up`` computed in
    float32, in one kernel. Sums of token slots past M are left unwritten. ``block``: the
    values a program takes (a power of two, at least 128; default ``SILU_BLOCK``)."""
    src, split = buffer(x)
    m, two_i = x.shape
    inter = two_i // 2
    if m > MAX_TOKENS or inter % CHUNK:
        raise ValueError(f"x of shape {(m, two_i)}: at most 8 rows, I a multiple of 128")
    xq = torch.empty(m, inter, dtype=torch.float16, device=src.device)
    sums = torch.empty(inter // CHUNK, MAX_TOKENS, 4, dtype=torch.float32, device=src.device)
    block = min(block or SILU_BLOCK, triton.next_power_of_2(inter))
    rnd = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0) if split else 0
    _silu_mul_prep_kernel[(m, triton.cdiv(inter, block))](
        src, xq, sums, src.stride(-2), xq.stride(0), inter, src.stride(0) if split else 0,
        BLOCK=block, SPLIT=split, ROUND=rnd, num_warps=num_warps, **pdl.kwargs(xq),
    )  # fmt: skip
    return xq.view(torch.int32), sums


def silu_mul_prep_ref(x: torch.Tensor | SplitPartials) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: SiLU·mul in float32 (partials summed and rounded as the engine
    does), then ``prep_ref``."""
    full = finished(x)
    g, u = full.float().chunk(2, dim=-1)
    return prep_ref(g / (1.0 + torch.exp(-g)) * u)


@triton.jit
def _rms_row(x_ptr, r_ptr, offs, mask, stride_s, HAS_RESIDUAL: tl.constexpr,
             SPLIT: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """Row values at ``offs`` (the x pointers already at the row) as ``_rms_norm_kernel``
    takes them: split-K partials summed in split order and rounded to ``DTYPE``, then
    the residual added with torch's rounding."""
    if SPLIT == 0:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(DTYPE)
    else:  # split-K partials (kiln.kernels.partials): summed in split order, then rounded
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(x_ptr + s * stride_s + offs, mask=mask, other=0.0)
        x = acc.to(DTYPE)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(DTYPE)  # torch's rounding of x + r
    return x


@triton.jit
def _rms_norm_prep_kernel(x_ptr, r_ptr, w_ptr, xq_ptr, sum_ptr, r_out_ptr, stride_x,
                          stride_r, stride_q, stride_ro, hidden, eps, stride_s,
                          HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                          SLICE: tl.constexpr, SPLIT: tl.constexpr = 0,
                          PDL: tl.constexpr = 0):  # fmt: skip
    """Grid (tokens, hidden / SLICE): each program sums the whole row's squares (the same
    reduction in every program, so the same inverse) and writes its SLICE values (whole
    chunks) prepared, and the new residual there."""
    pdl.pdl_enter(PDL >= 1, False)  # kiln.kernels.pdl: let the next grid launch
    row = tl.program_id(0)
    dt = r_out_ptr.dtype.element_ty  # x's dtype, with residual or not
    chunk = tl.program_id(1) * (SLICE // 128) + tl.arange(0, SLICE // 128)
    so = chunk[:, None] * 128 + tl.arange(0, 128)[None, :]  # (chunks, 128)
    mask = so < hidden
    # the weight is no kernel's output: loaded before the wait, off the critical path
    w = tl.load(w_ptr + so, mask=mask, other=0.0).to(tl.float32)
    pdl.pdl_enter(False, PDL >= 2)  # then wait for the grid before
    xp = x_ptr + row * stride_x
    rp = r_ptr + row * stride_r
    offs = tl.arange(0, BLOCK)
    xf = _rms_row(xp, rp, offs, offs < hidden, stride_s, HAS_RESIDUAL, SPLIT, dt).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    x = _rms_row(xp, rp, so, mask, stride_s, HAS_RESIDUAL, SPLIT, dt)
    if HAS_RESIDUAL:
        tl.store(r_out_ptr + row * stride_ro + so, x, mask=mask)
    # round the normalized value to x's dtype first, as the reference does, then scale
    y = (x.to(tl.float32) * inv).to(dt).to(tl.float32) * w
    _store_prepared(y, so, mask, xq_ptr + row * stride_q, sum_ptr, row, chunk,
                    chunk * 128 < hidden)  # fmt: skip


def rms_norm_prep_triton(
    x: torch.Tensor | SplitPartials,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    piece: int | None = None,
    num_warps: int = NORM_WARPS,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """RMSNorm of (M <= 8, H) x (H a multiple of 128; or its split-K partials), optionally
    after the residual add, as ``kiln.kernels.rmsnorm.rms_norm_triton`` computes it but
    written as the float16-code kernel's x: ``((xq, sums), x + residual)``, the first as
    ``prep_ref`` of the normalized values times the weight in float32 (not rounded to x's
    dtype). A row is spread over programs of up to 1,024 values (eight chunks) each: one
    program a row took 6.2 µs at 4,096 on an H100, against RMSNorm's 1.3 (2026-12-06).
    Sums of token slots past M are left unwritten. ``piece``: the values a program writes
    (a power of two, at least 128; default up to ``SLICE``)."""
    src, split = buffer(x)
    t, h = x.shape
    if t > MAX_TOKENS or h % CHUNK:
        raise ValueError(f"x of shape {(t, h)}: at most 8 rows, hidden a multiple of 128")
    xq = torch.empty(t, h, dtype=torch.float16, device=src.device)
    sums = torch.empty(h // CHUNK, MAX_TOKENS, 4, dtype=torch.float32, device=src.device)
    r_out = torch.empty(t, h, dtype=x.dtype, device=src.device)  # x's dtype, for the kernel
    r = residual if residual is not None else r_out
    block = triton.next_power_of_2(h)
    piece = min(piece or SLICE, block)
    _rms_norm_prep_kernel[(t, triton.cdiv(h, piece))](
        src, r, weight, xq, sums, r_out, src.stride(-2), r.stride(0), xq.stride(0),
        r_out.stride(0), h, eps, src.stride(0) if split else 0,
        HAS_RESIDUAL=residual is not None, BLOCK=block, SLICE=piece, SPLIT=split,
        num_warps=num_warps, **pdl.kwargs(xq),
    )  # fmt: skip
    return (xq.view(torch.int32), sums), r_out if residual is not None else None


def rms_norm_prep_ref(
    x: torch.Tensor | SplitPartials,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """The reference: ``kiln.kernels.rmsnorm.rms_norm_ref``'s sum and normalization (the
    normalized value rounded to x's dtype), times the weight in float32, then
    ``prep_ref``."""
    x = finished(x)
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()
    return prep_ref(y * weight.float()), residual
