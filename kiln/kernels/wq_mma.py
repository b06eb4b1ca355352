"""Few-row int4 weight-only matmul on the tensor cores (Gluon, ``mma.sync`` m16n8k16 bf16):
the x rows (up to 16 tokens) are the A operand, eight weight rows the B operand.

Why: the one-row FMA kernel (``kiln.kernels.wq_gluon``) spends about 25 instructions per
32-bit word of codes (shifts, masks and one float FMA per code), and its time is about
its loads' plus its arithmetic's. Here a word costs seven integer instructions (three
shifts, four ``lop3``) and two ``mma``: the codes become bfloat16 ``128 + q`` pairs under
the exponent of 128 (exact), the tensor core multiplies them by x and sums in float32,
and per 128-code chunk ``scale * (acc - (128 + zero) * sum(x))`` restores the affine
code, with ``sum(x)`` from one more ``mma`` against ones per chunk (shared by all rows).

Fragments (PTX ISA, ``mma.m16n8k16`` with .bf16): lane l = 4 g + t holds A[g][2t, 2t+1]
(a0), A[g + 8][2t, 2t+1] (a1), A[g][2t+8, 2t+9] (a2), A[g + 8][2t+8, 2t+9] (a3);
B[2t, 2t+1][g] (b0), B[2t+8, 2t+9][g] (b1); C[g][2t, 2t+1] (c0, c1), C[g + 8][..] (c2, c3).
The k order inside an mma is free as long as A and B agree, so each lane reads its weight
row's 16 bytes (words 4t..4t+3 of a 128-code chunk) in one load and uses the codes in the
order ``lop3`` unpacks them: word j, half h gives b0 = codes (2h, 2h+4), b1 = (2h+1, 2h+5),
and a0/a2 hold x at those same k (two x pairs merged per register).

Gluon does not run in Triton's interpreter: the GPU tests check this kernel against
``wq_gemm.wq_linear_ref``."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.kernels import pdl
from kiln.kernels.wq_gluon import _gdc

CHUNK = 128  # codes per lane-quad per row: 4 lanes x 4 words x 8 codes
_MMA = gl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)


@gluon.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return gl.inline_asm_elementwise(
        _MMA, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _a_regs(xo, xm, i: gl.constexpr):
    """x at the k of step i = 2 j + h (word j, half h): a0 = (x[8j+2h], x[8j+2h+4]),
    a2 = (x[8j+2h+1], x[8j+2h+5]) from the pairs u[4j+h] and u[4j+h+2] at ``xo``."""
    ua = gl.load(xo + (4 * (i // 2) + i % 2), mask=xm, other=0)
    ub = gl.load(xo + (4 * (i // 2) + i % 2 + 2), mask=xm, other=0)
    return (ua & 0xFFFF) | (ub << 16), ((ua >> 16) & 0xFFFF) | (ub & -65536)


@gluon.jit
def _b_regs(w, h: gl.constexpr):
    """bfloat16 pairs 128 + q of word ``w``'s codes (2h, 2h+4) and (2h+1, 2h+5)."""
    b0 = ((w >> (8 * h)) & 0x000F000F) | 0x43004300
    b1 = ((w >> (8 * h + 4)) & 0x000F000F) | 0x43004300
    return b0, b1


@gluon.jit
def _chunk(wd, xo, xm, xo8, xm8, zero, ones, S2: gl.constexpr, L: gl.constexpr,
           M16: gl.constexpr):
    """One 128-code chunk: the weight rows' float32 sums of (128 + q) x (c0..c3, (R, 32 NW))
    and x's sums (s0, s2, (32 NW,)) for tokens g and g + 8."""
    w01, w23 = gl.split(gl.reshape(wd, [wd.shape[0], wd.shape[1], 2, 2]))
    w0, w2 = gl.split(w01)
    w1, w3 = gl.split(w23)
    z2 = gl.zeros(w0.shape, gl.float32, S2)
    c0, c1, c2, c3 = z2, z2, z2, z2
    z1 = gl.zeros(zero.shape, gl.float32, L)
    s0, s1, s2, s3 = z1, z1, z1, z1
    for i in gl.static_range(8):
        a0, a2 = _a_regs(xo, xm, i)
        if M16:
            a1, a3 = _a_regs(xo8, xm8, i)
        else:
            a1, a3 = zero, zero
        s0, s1, s2, s3 = _mma(a0, a1, a2, a3, ones, ones, s0, s1, s2, s3)
        if i // 2 == 0:
            w = w0
        elif i // 2 == 1:
            w = w1
        elif i // 2 == 2:
            w = w2
        else:
            w = w3
        b0, b1 = _b_regs(gl.convert_layout(w, S2), i % 2)
        c0, c1, c2, c3 = _mma(gl.expand_dims(a0, 0), gl.expand_dims(a1, 0),
                              gl.expand_dims(a2, 0), gl.expand_dims(a3, 0), b0, b1,
                              c0, c1, c2, c3)  # fmt: skip
    return c0, c1, c2, c3, s0, s2


@gluon.jit
def _wq4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_om, k_per_split,
                    R: gl.constexpr, SPLIT_K: gl.constexpr, GROUP: gl.constexpr,
                    NW: gl.constexpr, M16: gl.constexpr, HAS_BIAS: gl.constexpr,
                    PDL: gl.constexpr = False):  # fmt: skip
    """Grid (N / (8 R NW), SPLIT_K); M <= 8 (16 with ``M16``) rows of x. x: bfloat16 rows
    as int32 pairs (stride in pairs); w: (N, K/8) int32 words (stride in words); scale
    float32, zero uint8 (N, K/GROUP), GROUP % 128 == 0; k_per_split % 128 == 0. Warp w
    takes R groups of eight weight rows; with SPLIT_K > 1 float32 partials go to
    ``part_ptr`` (SPLIT_K, M, N). ``PDL``: as in ``wq_gluon._wq4_rows_kernel``."""
    P: gl.constexpr = gl.BlockedLayout([R, 1, 4], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(2, P)  # (R, 32 NW): one element per lane and group
    L: gl.constexpr = gl.SliceLayout(0, S2)  # (32 NW,): one per lane
    if PDL:
        _gdc(False)
    lid = gl.arange(0, 32 * NW, layout=L)
    g = (lid % 32) // 4  # B's weight row in the group; A's and C's token
    t = lid % 4
    grp = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, S2)), 1)
    base = gl.program_id(0) * (8 * R * NW) + (grp + gl.expand_dims((lid // 32) * R, 0)) * 8
    brow = gl.minimum(base + gl.expand_dims(g, 0), N - 1)  # (R, 32 NW)
    crow = base + gl.expand_dims(2 * t, 0)  # C's rows: crow, crow + 1
    r0 = gl.minimum(crow, N - 1) * stride_sn
    r1 = gl.minimum(crow + 1, N - 1) * stride_sn
    w4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, P)))
    wp = (w_ptr + gl.expand_dims(brow.to(gl.int64) * stride_wn + gl.expand_dims(t * 4, 0), 2)
          + gl.expand_dims(gl.expand_dims(w4, 0), 1))  # fmt: skip
    xm = g < M
    xo = x_ptr + g * stride_xm + t * 16
    xm8 = g + 8 < M
    xo8 = x_ptr + gl.minimum(g + 8, M - 1) * stride_xm + t * 16
    zero = gl.zeros([32 * NW], gl.int32, L)
    ones = gl.full([32 * NW], 0x3F803F80, gl.int32, L)
    k_lo = gl.program_id(1) * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    t0 = gl.zeros([R, 32 * NW], gl.float32, S2)
    t1, t2, t3 = t0, t0, t0
    for k0 in range(k_lo, k_hi, 128):
        wd = gl.load(wp + gl.multiple_of(k0 // 8, 16), eviction_policy="evict_first")
        if PDL:  # noqa: SIM102 (compile-time, then run-time): the first chunk's words, then wait
            if k0 == k_lo:
                _gdc(True)
        c0, c1, c2, c3, s0, s2 = _chunk(wd, xo + k0 // 2, xm, xo8 + k0 // 2, xm8, zero, ones,
                                        S2, L, M16)  # fmt: skip
        sa = gl.load(s_ptr + r0 + k0 // GROUP)
        sb = gl.load(s_ptr + r1 + k0 // GROUP)
        za = gl.load(z_ptr + r0 + k0 // GROUP).to(gl.float32) + 128.0
        zb = gl.load(z_ptr + r1 + k0 // GROUP).to(gl.float32) + 128.0
        e0 = gl.expand_dims(s0, 0)
        t0 += sa * (c0 - za * e0)
        t1 += sb * (c1 - zb * e0)
        if M16:
            e2 = gl.expand_dims(s2, 0)
            t2 += sa * (c2 - za * e2)
            t3 += sb * (c3 - zb * e2)
    tok = gl.expand_dims(g, 0)
    _store(t0, t1, tok, crow, b_ptr, out_ptr, part_ptr, M, N, stride_om, SPLIT_K, HAS_BIAS)
    if M16:
        _store(t2, t3, tok + 8, crow, b_ptr, out_ptr, part_ptr, M, N, stride_om, SPLIT_K,
               HAS_BIAS)  # fmt: skip


@gluon.jit
def _store(y0, y1, tok, crow, b_ptr, out_ptr, part_ptr, M, N, stride_om,
           SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr):  # fmt: skip
    """Rows ``crow`` and ``crow + 1`` of token ``tok``: the output, or split's partial."""
    for i in gl.static_range(2):
        y = y0 if i == 0 else y1
        n = crow + i
        ok = (tok < M) & (n < N)
        if SPLIT_K == 1:
            if HAS_BIAS:
                y += gl.load(b_ptr + n, mask=ok, other=0.0).to(gl.float32)
            gl.store(out_ptr + tok * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            gl.store(part_ptr + (gl.program_id(1) * M + tok) * N + n, y, mask=ok)


def mma_ok(x: torch.Tensor, k: int, group: int, smooth: torch.Tensor | None) -> bool:
    """Whether ``_wq4_mma_kernel`` takes the call: a CUDA bfloat16 x of at most 16 rows,
    whole 128-code chunks, groups of whole chunks, no smoothing."""
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] <= 16 and smooth is None
        and k % CHUNK == 0 and group % CHUNK == 0 and x.stride(0) % 2 == 0
    )  # fmt: skip


def wq4_mma(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            bias: torch.Tensor | None = None, r: int = 2, num_warps: int = 1,
            split: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """(M, N) = x @ dequantized(w).T (+ bias) in x's dtype; ``scale`` float32. Splits of
    whole chunks; split > 1 adds ``gemv.split_k_reduce``."""
    from kiln.kernels.gemv import split_k_reduce

    m, k = x.shape
    n = w.shape[0]
    group = k // scale.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    chunks = k // CHUNK
    split = max(1, min(split, chunks))
    k_per_split = triton.cdiv(chunks, split) * CHUNK
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(n, 8 * r * num_warps), split)
    _wq4_mma_kernel[grid](
        x.view(torch.int32), w.view(torch.int32), scale, zero, bias if bias is not None else out,
        out, part, m, n, k, x.stride(0) // 2, w.stride(0) // 4, scale.stride(0), out.stride(0),
        k_per_split, R=r, SPLIT_K=split, GROUP=group, NW=num_warps, M16=m > 8,
        HAS_BIAS=bias is not None, num_warps=num_warps, **pdl.dependent_kwargs(x),
    )  # fmt: skip
    if split > 1:
        split_k_reduce(part, out, bias)
    return out
