"""fp8 x fp8 matmul for one to 32 rows on the tensor cores (Gluon, ``mma.sync``
m16n8k32 e4m3): sixteen weight rows are the A operand, x's rows (tokens) B in tiles of
eight, each tile's ``mma`` on the same weight fragments (one load of the weights for all
of them).

Why: at one to four rows the fp8 skinny kernel (``kiln.kernels.fp8_gemv``) widens every
code to float32 before its multiply and read the weights at about 2.3 TB/s on the H200
(gate_up 50 µs a call, 2026-12-02), so an fp8 engine decoded one sequence slower than
bf16 (4.63 against 4.29 ms). Here the codes go to the tensor core as they are: a lane's
16-byte load of a weight row holds four A registers' worth of e4m3 codes, two ``mma`` use
them, and nothing is unpacked. Measured there: gate_up 32.8 µs a call at one row (3.6
TB/s), and fp8 + fp8 KV decoding one sequence in 3.43 ms
(``benchmarks/results/2026-12-02-h200-fp8-mma-925c09d.json``). With two token tiles a
build picked it at 16 rows for every Llama-3.1-8B shape (a call about 20 % dearer than at
eight) and 16 sequences decoded in 4.98 ms against 6.00 with ``torch._scaled_mm``; at 32
rows ``_scaled_mm`` won (``…-latency-fp8-32-rows-ae7101a.json``).

Fragments (PTX ISA, ``mma.m16n8k32`` with 8-bit types): lane l = 4 g + t holds
A[g][4t..4t+3] (a0), A[g + 8][4t..4t+3] (a1), A[g][4t+16..4t+19] (a2), A[g + 8][..] (a3);
B[4t..4t+3][g] (b0), B[4t+16..4t+19][g] (b1); C[g][2t, 2t+1] (c0, c1), C[g + 8][..] (c2,
c3). The k order inside an ``mma`` is free as long as A and B agree: lane (g, t) loads
bytes 16t..16t+15 of a 64-code chunk of rows g and g + 8, and of x's row g; words 0 and
1 feed the first ``mma`` (as a0 / a2 and b0 / b1), words 2 and 3 the second. A
program's warps take alternate chunks of K and are summed at the end; float32 sums are
multiplied by the row's and the token's scales (before a split's partial is written),
the bias comes last. The codes' products are exact and summed in float32, as in
``fp8_gemv.fp8_skinny_ref``, in another order.

Gluon does not run in Triton's interpreter: the GPU tests check this kernel against
``fp8_gemv.fp8_skinny_ref``, and a CPU test compiles it for sm_90."""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.kernels import gemv, pdl
from kiln.kernels.wq_gluon import _gdc
from kiln.kernels.wq_mma import _store, _words, _words_layout

CHUNK = 64
"""Codes (bytes) of a row a warp takes per step: four lanes of 16 bytes."""
TILE_M = 8
"""Tokens a B operand holds."""
MAX_M = 32
"""Rows a program takes: four token tiles."""
_CH = gl.constexpr(CHUNK)
_MMA = gl.constexpr(
    "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)


@gluon.jit
def _mma8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return gl.inline_asm_elementwise(
        _MMA, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _xwords(u, L: gl.constexpr):
    """(NW, 32, 4) -> its four words, (NW, 32) each in ``L``."""
    u01, u23 = gl.split(gl.reshape(u, [u.shape[0], u.shape[1], 2, 2]))
    u0, u2 = gl.split(u01)
    u1, u3 = gl.split(u23)
    return (gl.convert_layout(u0, L), gl.convert_layout(u1, L), gl.convert_layout(u2, L),
            gl.convert_layout(u3, L))  # fmt: skip


@gluon.jit
def _tile(acc, j: gl.constexpr, a0, a1, a2, a3, b0, b1, b2, b3, u, L: gl.constexpr):
    """Token tile ``j``'s sums (``acc[4 j:4 j + 4]``) plus the chunk's: weight rows g (a)
    and g + 8 (b) as words, times x's (NW, 32, 4) words ``u``."""
    x0, x1, x2, x3 = _xwords(u, L)
    c0, c1, c2, c3 = _mma8(a0, b0, a1, b1, gl.expand_dims(x0, 1), gl.expand_dims(x1, 1),
                           acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
                           acc[4 * j + 3])  # fmt: skip
    return _mma8(a2, b2, a3, b3, gl.expand_dims(x2, 1), gl.expand_dims(x3, 1), c0, c1, c2, c3)


@gluon.jit
def _chunk(acc, wa, wb, xp, x8, xg, M, km, NT: gl.constexpr, S: gl.constexpr,
           L: gl.constexpr):  # fmt: skip
    """Each warp's 64-code chunk: rows g (wa) and g + 8 (wb), (NW, R, 32, 4) words, times
    x's words at ``xp`` (the lane's token ``xg``; token tile j ``x8`` j words further;
    nothing past row M or outside the chunk mask ``km``), added to the float32 sums
    ``acc`` (4 ``NT`` of (NW, R, 32))."""
    a0, a1, a2, a3 = _words(wa, S)
    b0, b1, b2, b3 = _words(wb, S)
    u = gl.load(xp, mask=(xg < M) & km, other=0)
    out = _tile(acc, 0, a0, a1, a2, a3, b0, b1, b2, b3, u, L)
    for j in gl.static_range(1, NT):
        u = gl.load(xp + j * x8, mask=(xg + 8 * j < M) & km, other=0)
        out = out + _tile(acc, j, a0, a1, a2, a3, b0, b1, b2, b3, u, L)
    return out


@gluon.jit
def _fp8_mma_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, part_ptr, M, N, K,
                    stride_xm, stride_wn, stride_om, sx_row, k_per_split, R: gl.constexpr,
                    SPLIT_K: gl.constexpr, NW: gl.constexpr, HAS_BIAS: gl.constexpr,
                    PDL: gl.constexpr = False, NT: gl.constexpr = 1):  # fmt: skip
    """Grid (N / (16 R), SPLIT_K). x: (M, K / 4) e4m3 codes as int32 words, M <= 8 ``NT``
    (``NT`` token tiles of eight on the same weight fragments); w: (N,
    K / 4) the same; strides in words; K % 64 == 0, k_per_split % 64 == 0. sx: float32, one
    per row (``sx_row`` 1) or one in all (0); sw: one per weight row. A program takes R
    groups of sixteen weight rows; with SPLIT_K > 1 scaled float32 partials go to
    ``part_ptr`` (SPLIT_K, M, N). ``PDL``: the first step's weights are loaded before
    ``griddepcontrol.wait`` (nothing earlier in the step writes them)."""
    P: gl.constexpr = _words_layout(R, NW)  # (NW, R, 32, 4)
    S: gl.constexpr = gl.SliceLayout(3, P)  # (NW, R, 32)
    L: gl.constexpr = gl.SliceLayout(1, S)  # (NW, 32)
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    if PDL:
        _gdc(False)
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(0, S)))
    g = lane // 4
    t = lane % 4
    grp = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(0, S)))
    row = gl.expand_dims(
        gl.program_id(0) * (16 * R) + gl.expand_dims(grp, 1) * 16 + gl.expand_dims(g, 0), 0
    )  # fmt: skip  (1, R, 32): rows row, row + 8
    ra = gl.minimum(row, N - 1)
    rb = gl.minimum(row + 8, N - 1)
    wid = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, S)))
    kw4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(wid * _CH, 1), 2), 3)  # (NW,1,1,1)
    w4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, P))))
    w4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(w4, 0), 1), 2)  # (1, 1, 1, 4)
    t4 = gl.expand_dims(gl.expand_dims(t * 4, 0), 0)  # (1, 1, 32): the lane's first word
    wpa = w_ptr + gl.expand_dims(ra.to(gl.int64) * stride_wn + t4, 3) + (w4 + kw4 // 4)
    wpb = w_ptr + gl.expand_dims(rb.to(gl.int64) * stride_wn + t4, 3) + (w4 + kw4 // 4)
    xl = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
    xg = gl.expand_dims(gl.expand_dims(xl // 4, 0), 2)  # (1, 32, 1): the lane's token
    x4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
    kwx = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))) * _CH
    kwx = gl.expand_dims(gl.expand_dims(kwx, 1), 2)  # (NW, 1, 1)
    xp = (x_ptr + xg * stride_xm + gl.expand_dims(gl.expand_dims((xl % 4) * 4, 0), 2)
          + gl.expand_dims(gl.expand_dims(x4, 0), 1) + kwx // 4)  # fmt: skip
    k_lo = gl.program_id(1) * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    z = gl.zeros([NW, R, 32], gl.float32, S)
    acc = (z, z, z, z) * NT
    x8 = 8 * stride_xm  # words from one token tile to the next
    STEP: gl.constexpr = _CH * NW
    wa = gl.load(wpa + gl.multiple_of(k_lo // 4, 16), mask=k_lo + kw4 < k_hi, other=0,
                 eviction_policy="evict_first")  # fmt: skip
    wb = gl.load(wpb + gl.multiple_of(k_lo // 4, 16), mask=k_lo + kw4 < k_hi, other=0,
                 eviction_policy="evict_first")  # fmt: skip
    if PDL:  # x is the kernel before's output
        _gdc(True)
    for k0 in range(k_lo, k_hi, STEP):
        kn = k0 + STEP  # the next step's words, loaded before this step's arithmetic
        na = gl.load(wpa + gl.multiple_of(kn // 4, 16), mask=kn + kw4 < k_hi, other=0,
                     eviction_policy="evict_first")  # fmt: skip
        nb = gl.load(wpb + gl.multiple_of(kn // 4, 16), mask=kn + kw4 < k_hi, other=0,
                     eviction_policy="evict_first")  # fmt: skip
        acc = _chunk(acc, wa, wb, xp + gl.multiple_of(k0 // 4, 16), x8, xg, M,
                     k0 + kwx < k_hi, NT, S, L)  # fmt: skip
        wa, wb = na, nb
    rw = gl.convert_layout(gl.reshape(row, [R, 32]), gl.SliceLayout(0, S))
    swa = gl.load(sw_ptr + gl.minimum(rw, N - 1)).to(gl.float32)
    swb = gl.load(sw_ptr + gl.minimum(rw + 8, N - 1)).to(gl.float32)
    for j in gl.static_range(NT):  # token tile j: tokens 8 j + 2t, 8 j + 2t + 1
        tok = gl.expand_dims(8 * j + 2 * t, 0)  # (1, 32)
        sx0 = gl.load(sx_ptr + gl.minimum(tok, M - 1) * sx_row)
        sx1 = gl.load(sx_ptr + gl.minimum(tok + 1, M - 1) * sx_row)
        _store(gl.sum(acc[4 * j], axis=0) * swa * sx0, rw, tok, b_ptr, out_ptr, part_ptr, M,
               N, stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip
        _store(gl.sum(acc[4 * j + 1], axis=0) * swa * sx1, rw, tok + 1, b_ptr, out_ptr,
               part_ptr, M, N, stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip
        _store(gl.sum(acc[4 * j + 2], axis=0) * swb * sx0, rw + 8, tok, b_ptr, out_ptr,
               part_ptr, M, N, stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip
        _store(gl.sum(acc[4 * j + 3], axis=0) * swb * sx1, rw + 8, tok + 1, b_ptr, out_ptr,
               part_ptr, M, N, stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip


def fp8_mma_ok(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether ``fp8_mma`` takes the call: CUDA, at most ``MAX_M`` rows, K a multiple of
    ``CHUNK``, rows of x and w 16-byte aligned with unit stride along K."""
    m, k = xq.shape
    return (
        xq.is_cuda and m <= MAX_M and k % CHUNK == 0 and xq.stride(1) == 1
        and wq.stride(1) == 1 and xq.stride(0) % 16 == 0 and wq.stride(0) % 16 == 0
        and xq.storage_offset() % 16 == 0 and wq.storage_offset() % 16 == 0
    )  # fmt: skip


def fp8_mma_candidates(n: int, k: int) -> list[dict[str, Any]]:
    """Tuner candidates (``MMA``: R groups of sixteen rows a program, warps, split-K)."""
    if k % CHUNK:
        return []
    out = []
    # the H200's one-row picks (2026-12-02) were split 4 for all four Llama-3.1-8B shapes,
    # the list's largest then: split 8 joined after, not yet timed
    for r, nw, split in ((1, 4, 1), (1, 4, 2), (1, 8, 1), (2, 4, 1), (2, 2, 1), (1, 2, 2),
                         (2, 4, 2), (1, 8, 2), (1, 4, 4), (2, 2, 4), (1, 4, 8),
                         (1, 2, 8)):  # fmt: skip
        if split == 1 or k // (CHUNK * nw) >= 2 * split:  # at least two steps a split
            out.append({"MMA": True, "R": r, "SPLIT_K": split, "num_warps": nw})
    return out


def fp8_mma(
    xq: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: dict[str, Any],
) -> torch.Tensor:
    """``fp8_gemv.fp8_skinny_ref``'s contract on the tensor cores, where ``fp8_mma_ok``."""
    m, k = xq.shape
    n = wq.shape[0]
    if not fp8_mma_ok(xq, wq) or wq.shape[1] != k:
        raise ValueError(
            f"fp8 mma: x {tuple(xq.shape)}, w {tuple(wq.shape)}: CUDA, at most {MAX_M} rows, "
            f"K a multiple of {CHUNK}, 16-byte aligned rows"
        )
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    r, nw = config["R"], config["num_warps"]
    chunks = k // CHUNK
    split = max(1, min(config["SPLIT_K"], chunks))
    k_per_split = triton.cdiv(chunks, split) * CHUNK
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    sx = sx.reshape(-1).float()
    _fp8_mma_kernel[(triton.cdiv(n, 16 * r), split)](
        xq.view(torch.int32), wq.view(torch.int32), sx, sw.reshape(-1),
        bias if bias is not None else out, out, part, m, n, k, xq.stride(0) // 4,
        wq.stride(0) // 4, out.stride(0), 1 if sx.numel() == m else 0, k_per_split, R=r,
        SPLIT_K=split, NW=nw, HAS_BIAS=bias is not None, num_warps=nw,
        NT=triton.cdiv(m, TILE_M), **pdl.dependent_kwargs(xq),
    )  # fmt: skip
    if split > 1:
        gemv.split_k_reduce(part, out, bias)
    return out
