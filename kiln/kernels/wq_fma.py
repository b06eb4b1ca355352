"""The weight-only kernels' forms for one to four rows without tensor cores: broadcast-multiply
(int8, int4) and int4 on 32-bit words, with the words kernel's launch and eligibility
(``kiln.kernels.wq_gemm`` launches them all and documents the layouts), and the
program-tile helper the tensor-core kernel shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._triton import INTERPRET
from kiln.kernels.gemv import _store_result


@triton.jit
def _program_tiles(w_ptr, M, N, stride_wn, k_per_split, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """This program's split, output columns and rows of x (grid (N / BLOCK_N, SPLIT_K,
    M / BLOCK_M)); columns past N read row N - 1 (never stored); the first K of its split
    and its rows of the weight."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1)
    w_row = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    return pid_k, offs_n, offs_m, offs_m < M, rows, pid_k * k_per_split, w_row


@triton.jit
def _wq_fma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, sm_ptr, b_ptr, out_ptr, part_ptr,
                   M, N, K, stride_xm, stride_wn, stride_sn, stride_om, k_per_split,
                   K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                   HAS_BIAS: tl.constexpr):  # fmt: skip
    """int8, the broadcast-multiply variant for one to four rows: no tensor cores, the
    codes widened to float32 in registers and multiplied into a float32 (BLOCK_N, BLOCK_M,
    BLOCK_K) accumulator summed over K once at the end; the row scale applied last.
    ``sm_ptr``: the reciprocals of the smoothing factors."""
    pid_k, offs_n, offs_m, m_ok, rows, k_lo, w_row = _program_tiles(
        w_ptr, M, N, stride_wn, k_per_split, BLOCK_M, BLOCK_N
    )
    dt = x_ptr.dtype.element_ty
    acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        kk = k_lo + k + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if HAS_SMOOTH:
            x = (x.to(tl.float32) * tl.load(sm_ptr + kk, mask=k_ok, other=1.0)[None, :]).to(dt)
        w = tl.load(w_row + kk[None, :], mask=k_ok[None, :], other=0,
                    eviction_policy="evict_first").to(tl.float32)  # fmt: skip
        acc3 += w[:, None, :] * x.to(tl.float32)[None, :, :]
    acc = tl.sum(acc3, axis=2) * tl.load(s_ptr + rows)[:, None]  # (BLOCK_N, BLOCK_M)
    _store_result(acc, offs_n, offs_m, b_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                  SPLIT_K, HAS_BIAS)  # fmt: skip


@triton.jit
def _wq4_fma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, sm_ptr, b_ptr, out_ptr, part_ptr,
                    M, N, K, stride_xm, stride_wn, stride_sn, stride_om, k_per_split,
                    K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr,
                    EVEN_K: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    """int4, the broadcast-multiply variant for one row per program (batch-1 decode; grid
    (M, N / BLOCK_N, SPLIT_K), so the programs of a few rows that share a weight tile run
    together and read it once from memory): no tensor cores. A K tile of BLOCK_K codes is
    NG chunks of GS codes sharing a scale (the tile lies in one group, or holds whole
    groups), held as (BLOCK_N, NG, GS / 2) tensors of bytes: the low nibbles (even k)
    multiply x's even columns, the high nibbles (odd k) its odd ones, so the codes are never
    reordered. Codes become floats without int -> float conversions: the bits
    0x4B000000 | q are the float32 2**23 + q, and subtracting 2**23 + zero gives q - zero
    exactly. Each chunk's products are summed before its scale multiplies them. Without
    ``EVEN_K`` (K not a whole number of tiles per split) loads are masked. ``sm_ptr``: the
    reciprocals of the smoothing factors."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r3 = tl.minimum(offs_n, N - 1)[:, None, None]  # columns past N read row N - 1
    w3 = w_ptr + r3.to(tl.int64) * stride_wn
    x_row = x_ptr + pid_m * stride_xm
    dt = x_ptr.dtype.element_ty
    GSB: tl.constexpr = GS // 2
    NG: tl.constexpr = BLOCK_K // GS
    g = tl.arange(0, NG)
    byte3 = (g[:, None] * GSB + tl.arange(0, GSB)[None, :])[None, :, :]  # (1, NG, GSB)
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        k0 = k_lo + k
        ke = k0 + 2 * byte3  # the even columns
        gk = k0 + g * GS  # each chunk's first column
        sidx = r3 * stride_sn + (gk // GROUP)[None, :, None]  # (BLOCK_N, NG, 1)
        if EVEN_K:
            p = tl.load(w3 + (k0 // 2 + byte3), eviction_policy="evict_first").to(tl.int32)
            xe = tl.load(x_row + ke)
            xo = tl.load(x_row + ke + 1)
            sc = tl.load(s_ptr + sidx).to(tl.float32)
            zp = tl.load(z_ptr + sidx)
        else:  # past K (the last split's tail) all zeros
            k_ok = ke < K
            p = tl.load(w3 + (k0 // 2 + byte3), mask=k_ok, other=0,
                        eviction_policy="evict_first").to(tl.int32)  # fmt: skip
            xe = tl.load(x_row + ke, mask=k_ok, other=0.0)
            xo = tl.load(x_row + ke + 1, mask=k_ok, other=0.0)
            g_ok = (gk < K)[None, :, None]
            sc = tl.load(s_ptr + sidx, mask=g_ok, other=0.0).to(tl.float32)
            zp = tl.load(z_ptr + sidx, mask=g_ok, other=0)
        if HAS_SMOOTH:
            xe = (xe.to(tl.float32) * tl.load(sm_ptr + ke, mask=ke < K, other=1.0)).to(dt)
            xo = (xo.to(tl.float32) * tl.load(sm_ptr + ke + 1, mask=ke < K, other=1.0)).to(dt)
        zm = zp.to(tl.float32) + 8388608.0
        lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zm
        hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - zm
        t = lo * xe.to(tl.float32) + hi * xo.to(tl.float32)  # (BLOCK_N, NG, GSB)
        acc += tl.sum(t, axis=2) * tl.sum(sc, axis=2)
    y = tl.sum(acc, axis=1)[:, None]  # (BLOCK_N, 1)
    _store_result(y, offs_n, pid_m + tl.arange(0, 1), b_ptr, out_ptr, part_ptr, pid_k, M, N,
                  stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip


_NIB_LO: tl.constexpr = tl.constexpr(0x00078000)  # a byte moved to bits 15..22: low nibble
_NIB_HI: tl.constexpr = tl.constexpr(0x00780000)  # its high nibble


@triton.jit
def _x8(x_row, k0, j2, PAIRS: tl.constexpr):
    """x's columns 8j + i (i = 0..7) for the words ``j2`` of a tile, as float32: bfloat16
    read as int32 pairs (one load per two columns; the float32 of a bfloat16 is its bits
    moved up), other dtypes one column at a time."""
    if PAIRS:
        xp = x_row + k0 // 2 + 4 * j2
        u0, u1, u2, u3 = tl.load(xp), tl.load(xp + 1), tl.load(xp + 2), tl.load(xp + 3)
        return (
            (u0 << 16).to(tl.float32, bitcast=True), (u0 & -65536).to(tl.float32, bitcast=True),
            (u1 << 16).to(tl.float32, bitcast=True), (u1 & -65536).to(tl.float32, bitcast=True),
            (u2 << 16).to(tl.float32, bitcast=True), (u2 & -65536).to(tl.float32, bitcast=True),
            (u3 << 16).to(tl.float32, bitcast=True), (u3 & -65536).to(tl.float32, bitcast=True),
        )  # fmt: skip
    xk = x_row + k0 + 8 * j2
    return (
        tl.load(xk).to(tl.float32), tl.load(xk + 1).to(tl.float32),
        tl.load(xk + 2).to(tl.float32), tl.load(xk + 3).to(tl.float32),
        tl.load(xk + 4).to(tl.float32), tl.load(xk + 5).to(tl.float32),
        tl.load(xk + 6).to(tl.float32), tl.load(xk + 7).to(tl.float32),
    )  # fmt: skip


@triton.jit
def _nib(b, MASK: tl.constexpr, magic):
    """One nibble of a byte at bits 15..22 under the exponent bits ``magic`` (0x43000000,
    passed at run time so that mask-and-or is one ``lop3``): 128 + q/2 (low), 128 + 8q (high)."""
    return ((b & MASK) | magic).to(tl.float32, bitcast=True)


@triton.jit
def _wq4_words_kernel(x_ptr, w_ptr, s_ptr, z_ptr, sm_ptr, b_ptr, out_ptr, part_ptr,
                      M, N, K, stride_xm, stride_wn, stride_sn, stride_om, k_per_split, magic,
                      K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr,
                      PAIRS: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """int4 for one row of x per program (grid (M, N / BLOCK_N, SPLIT_K)), the codes read
    as 32-bit words (word j: codes 8j..8j+7, code 8j+i in bits 4i..4i+3), about 2.5
    instructions per code for the conversions and FMAs (the compiled kernel: 5.9 per code
    in all, Triton repeating x's loads and unpacking per row; ``kiln.kernels.wq_gluon``
    avoids that), against ``_wq4_fma_kernel``'s 4 and more: each byte is shifted once to
    bits 15..22 and each nibble becomes a float32 by one ``lop3`` (``_nib``); one FMA per
    code. Per word the low nibbles' products sum(128 + q/2) x and the high ones'
    sum(128 + 8q) x join as 16 lo + hi = 8 sum(q x) + 2048 sum(x_even) + 128 sum(x_odd);
    the two x terms and the zero point (times sum(x)) come off once per group from x's
    sums, which every program computes once for all its BLOCK_N columns. A K tile is NG
    chunks of GS codes sharing a scale (GS divides the group, or the tile holds whole
    groups); splits are whole tiles (the launcher checks), no smoothing (the launcher
    takes ``_wq4_fma_kernel`` for those). ``w_ptr``: the codes as int32 words, stride in
    words; ``x_ptr``: with ``PAIRS`` bfloat16 rows as int32 pairs, stride in pairs."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # columns past N read row N - 1 (never stored)
    GW: tl.constexpr = GS // 8
    NG: tl.constexpr = BLOCK_K // GS
    j2 = tl.arange(0, NG)[:, None] * GW + tl.arange(0, GW)[None, :]  # (NG, GW) tile words
    w3 = w_ptr + rows.to(tl.int64)[:, None, None] * stride_wn + j2[None, :, :]
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        k0 = k_lo + k
        wd = tl.load(w3 + tl.multiple_of(k0 // 8, 4), eviction_policy="evict_first")
        x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_row, k0, j2, PAIRS)
        sidx = rows[:, None] * stride_sn + ((k0 + tl.arange(0, NG) * GS) // GROUP)[None, :]
        sc = tl.load(s_ptr + sidx).to(tl.float32)
        zp = tl.load(z_ptr + sidx).to(tl.float32)
        xe = (x0 + x2) + (x4 + x6)
        xo = (x1 + x3) + (x5 + x7)
        xs = tl.sum(xe + xo, axis=1)  # (NG,)
        bias = tl.sum(xe * 2048.0 + xo * 128.0, axis=1)
        b0, b1, b2, b3 = wd << 15, wd << 7, wd >> 1, wd >> 9  # byte i at bits 15..22
        lo = _nib(b0, _NIB_LO, magic) * x0[None, :, :]
        lo += _nib(b1, _NIB_LO, magic) * x2[None, :, :]
        lo += _nib(b2, _NIB_LO, magic) * x4[None, :, :]
        lo += _nib(b3, _NIB_LO, magic) * x6[None, :, :]
        hi = _nib(b0, _NIB_HI, magic) * x1[None, :, :]
        hi += _nib(b1, _NIB_HI, magic) * x3[None, :, :]
        hi += _nib(b2, _NIB_HI, magic) * x5[None, :, :]
        hi += _nib(b3, _NIB_HI, magic) * x7[None, :, :]
        t = tl.sum(lo * 16.0 + hi, axis=2)  # (BLOCK_N, NG)
        acc += sc * ((t - bias[None, :]) * 0.125 - zp * xs[None, :])
    y = tl.sum(acc, axis=1)[:, None]  # (BLOCK_N, 1)
    _store_result(y, offs_n, pid_m + tl.arange(0, 1), b_ptr, out_ptr, part_ptr, pid_k, M, N,
                  stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip


def words_ok(x: torch.Tensor, k: int, gs: int, even: bool, smooth: torch.Tensor | None) -> bool:
    """Whether ``_wq4_words_kernel`` takes this call (else ``_wq4_fma_kernel`` does): 16-bit
    x (its products with the biased codes are exact in float32; bfloat16 rows read as
    int32 pairs need an even row stride and start), K whole words, splits of whole tiles,
    chunks of at least one word and no smoothing factors."""
    even_x = x.stride(0) % 2 == 0 and x.storage_offset() % 2 == 0
    x_ok = x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and even_x)
    return x_ok and k % 8 == 0 and gs % 8 == 0 and gs & (gs - 1) == 0 and even and smooth is None


def launch_words(grid: tuple[int, int, int], x: torch.Tensor, w: torch.Tensor, common: tuple,
                 cfg: dict, split: int, **kw) -> None:  # fmt: skip
    """The int4 word kernel on the launcher's arguments (``wq_gemm.wq_linear_triton``'s
    ``common``: x, w, scale, zero, smooth, bias, out, part, M, N, K, the four strides,
    k_per_split), x and w re-viewed as int32 (bfloat16 x as pairs), their strides converted:
    its Gluon form (``kiln.kernels.wq_gluon``) for a ``GLUON`` configuration on the GPU,
    else ``_wq4_words_kernel`` with the same tiles."""
    pairs = x.dtype == torch.bfloat16
    if cfg.get("GLUON") and not INTERPRET:
        from kiln.kernels import wq_gluon

        if wq_gluon.rows_ok(x, kw["GROUP"], cfg["BLOCK_K"]):
            wq_gluon.launch_rows(grid, x, w, common, cfg, kw["GROUP"], split, kw["HAS_BIAS"])
            return
    _wq4_words_kernel[grid](
        x.view(torch.int32) if pairs else x, w.view(torch.int32), *common[2:11],
        x.stride(0) // 2 if pairs else x.stride(0), w.stride(0) // 4, *common[13:],
        0x43000000, PAIRS=pairs, **kw,
    )  # fmt: skip
