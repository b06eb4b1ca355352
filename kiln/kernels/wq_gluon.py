"""The one-row int4 weight-only kernel in Gluon (Triton's explicit-layout dialect): the
arithmetic of ``kiln.kernels.wq_fma._wq4_words_kernel`` with a register layout plain Triton
does not produce. A (BLOCK_N, C, 4) tile of 32-bit words (C = BLOCK_K / 32 chunks of four
words, one 16-byte load per row) is laid out so that every thread holds all BLOCK_N rows of
its chunks, threads and warps along the chunks: a thread loads and unpacks its x values once
for BLOCK_N rows (the Triton kernel repeats that per row), a chunk's sum, bias and
zero-point correction stay in the thread, and the only cross-thread reduction is the last
one. The high nibbles' x are pre-scaled by 1/16 so both halves of a byte share one FMA
chain: sum((128 + q/2) x_even + (128 + 8q) x_odd / 16) = sum(q x) / 2 + 128 sum(x_even)
+ 8 sum(x_odd). Measured as an experiment first (scripts/experiments/int4_row_gluon.py).

Gluon does not run in Triton's interpreter: on the CPU the launcher takes the Triton word
kernel with the same tiles (``kiln.kernels.wq_gemm``), and the GPU tests check this one."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.kernels import pdl
from kiln.kernels.wq_fma import _NIB_HI as _HI
from kiln.kernels.wq_fma import _NIB_LO as _LO


@gluon.jit
def _nib(b, MASK: gl.constexpr, magic):
    return ((b & MASK) | magic).to(gl.float32, bitcast=True)


@gluon.jit
def _x_pairs(xk, C: gl.constexpr, NW: gl.constexpr, S0: gl.constexpr):
    """x's bfloat16 pairs for the C chunks of a K tile starting at ``xk`` (int32 pairs), as
    four (C, 4) tensors in ``S0`` (pair i of each word, i = 0..3): a thread reads its
    chunk's 64 bytes as four 16-byte loads (a (C, 4, 4) tile) and splits them in registers;
    four gathers of 4-byte words cost twice the kernel's load instructions (measured:
    scripts/experiments/int4_row_stream.py)."""
    PX: gl.constexpr = gl.BlockedLayout([1, 4, 4], [32, 1, 1], [NW, 1, 1], [2, 1, 0])
    c = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(2, PX)))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, PX)))
    i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, PX)))
    cj = gl.expand_dims(c * 16, 1) + gl.expand_dims(j * 4, 0)  # (C, 4): each word's first pair
    off = gl.expand_dims(cj, 2) + gl.expand_dims(gl.expand_dims(i, 0), 1)
    a, b = gl.split(gl.reshape(gl.load(xk + off), [C, 4, 2, 2]))
    u0, u2 = gl.split(a)
    u1, u3 = gl.split(b)
    return (gl.convert_layout(u0, S0), gl.convert_layout(u1, S0), gl.convert_layout(u2, S0),
            gl.convert_layout(u3, S0))  # fmt: skip


@gluon.jit
def _gdc(WAIT: gl.constexpr):
    """Programmatic dependent launch (Hopper): ``griddepcontrol.wait`` blocks until the
    grid this one may overlap has finished and its writes are visible;
    ``launch_dependents`` lets a grid launched after this one start early."""
    if WAIT:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    else:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _step(wd, sc, zp, x_row, k0, magic, C: gl.constexpr, NW: gl.constexpr, S0: gl.constexpr):
    """One K tile's contribution (BLOCK_N, C): words ``wd`` (BLOCK_N, C, 4), scales and
    zeros (BLOCK_N, C), x's pairs from ``x_row`` at element ``k0``."""
    u0, u1, u2, u3 = _x_pairs(x_row + gl.multiple_of(k0 // 2, 16), C, NW, S0)
    return _tile_sum(wd, sc, zp, u0, u1, u2, u3, magic)


@gluon.jit
def _tile_sum(wd, sc, zp, u0, u1, u2, u3, magic):
    """``_step``'s arithmetic on x's pairs ``u0``..``u3`` ((C, 4) each, pair i of each
    word) however they were read."""
    x0 = gl.expand_dims((u0 << 16).to(gl.float32, bitcast=True), 0)
    x1 = gl.expand_dims((u0 & -65536).to(gl.float32, bitcast=True), 0)
    x2 = gl.expand_dims((u1 << 16).to(gl.float32, bitcast=True), 0)
    x3 = gl.expand_dims((u1 & -65536).to(gl.float32, bitcast=True), 0)
    x4 = gl.expand_dims((u2 << 16).to(gl.float32, bitcast=True), 0)
    x5 = gl.expand_dims((u2 & -65536).to(gl.float32, bitcast=True), 0)
    x6 = gl.expand_dims((u3 << 16).to(gl.float32, bitcast=True), 0)
    x7 = gl.expand_dims((u3 & -65536).to(gl.float32, bitcast=True), 0)
    xe = (x0 + x2) + (x4 + x6)  # (1, C, 4)
    xo = (x1 + x3) + (x5 + x7)
    xs = gl.sum(xe + xo, axis=2)  # (1, C)
    bias = gl.sum(xe * 128.0 + xo * 8.0, axis=2)
    b0, b1, b2, b3 = wd << 15, wd << 7, wd >> 1, wd >> 9  # byte i at bits 15..22
    v = _nib(b0, _LO, magic) * x0
    v += _nib(b0, _HI, magic) * (x1 * 0.0625)
    v += _nib(b1, _LO, magic) * x2
    v += _nib(b1, _HI, magic) * (x3 * 0.0625)
    v += _nib(b2, _LO, magic) * x4
    v += _nib(b2, _HI, magic) * (x5 * 0.0625)
    v += _nib(b3, _LO, magic) * x6
    v += _nib(b3, _HI, magic) * (x7 * 0.0625)
    t = gl.sum(v, axis=2)  # (BLOCK_N, C), within the thread
    return sc * ((t - bias) * 2.0 - zp.to(gl.float32) * xs)


@gluon.constexpr_function
def row_layout(BLOCK_N, NW):
    """The (BLOCK_N, C, 4) word tile's layout: every thread holds all BLOCK_N rows of its
    chunks, threads and warps along the chunks."""
    return gl.BlockedLayout([BLOCK_N, 1, 4], [1, 32, 1], [1, NW, 1], [2, 1, 0])


@gluon.jit
def _tile_loads(w3, s_ptr, rs, z_ptr, cg, k0, GROUP: gl.constexpr):
    """One K tile's words (BLOCK_N, C, 4), scales and zeros (BLOCK_N, C) at element k0."""
    wd = gl.load(w3 + gl.multiple_of(k0 // 8, 4), eviction_policy="evict_first")
    sc = gl.load(s_ptr + rs + (cg + k0) // GROUP).to(gl.float32)
    zp = gl.load(z_ptr + rs + (cg + k0) // GROUP)
    return wd, sc, zp


@gluon.jit
def _rows_sum(x_row, w_ptr, s_ptr, z_ptr, rows, stride_wn, stride_sn, k_lo, k_per_split, magic,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr,
              NW: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    """The float32 sums of x (the row at ``x_row``, int32 pairs) with weight rows ``rows``
    ((BLOCK_N,) in ``SliceLayout(1, SliceLayout(2, row_layout))``) over K from ``k_lo``,
    ``k_per_split`` values in BLOCK_K tiles. With ``PDL`` the first tile's weights, scales
    and zeros load before ``griddepcontrol.wait``, and nothing else does (two tiles before
    it were slower: +92.5 µs a step on an H100, ``benchmarks/results/2026-12-06-h100-
    visit9-a1c1021.json``)."""
    P: gl.constexpr = row_layout(BLOCK_N, NW)
    S2: gl.constexpr = gl.SliceLayout(2, P)  # (BLOCK_N, C)
    S0: gl.constexpr = gl.SliceLayout(0, P)  # (C, 4)
    C: gl.constexpr = BLOCK_K // 32
    r2 = gl.expand_dims(rows, 1)
    c0 = gl.arange(0, C, layout=gl.SliceLayout(1, S0))
    wc = gl.expand_dims(c0, 1) * 4 + gl.expand_dims(gl.arange(0, 4, gl.SliceLayout(0, S0)), 0)
    w3 = w_ptr + gl.expand_dims(r2, 2).to(gl.int64) * stride_wn + gl.expand_dims(wc, 0)
    rs = r2 * stride_sn  # (BLOCK_N, 1): each row's scales and zeros
    cg = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, S2)) * 32, 0)  # (1, C)
    acc = gl.zeros([BLOCK_N, C], gl.float32, S2)
    for k in range(0, k_per_split, BLOCK_K):
        k0 = k_lo + k
        wd, sc, zp = _tile_loads(w3, s_ptr, rs, z_ptr, cg, k0, GROUP)
        if PDL:  # noqa: SIM102 (compile-time, then run-time): the first tile's reads, then wait
            if k == 0:
                _gdc(True)
        acc += _step(wd, sc, zp, x_row, k0, magic, C, NW, S0)
    return gl.sum(acc, axis=1)  # (BLOCK_N,)


@gluon.jit
def _wq4_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, M, N,
                     stride_xm, stride_wn, stride_sn, stride_om, k_per_split, magic,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr,
                     GROUP: gl.constexpr, NW: gl.constexpr, HAS_BIAS: gl.constexpr,
                     PDL: gl.constexpr = False):  # fmt: skip
    """Grid (M, N / BLOCK_N, SPLIT_K), one row of x per program. x: bfloat16 rows as int32
    pairs (stride in pairs); w: (N, K/8) int32 words (stride in words); scale float32 or
    float16, zero uint8 (N, K/GROUP); each chunk of 32 codes lies in one group (GROUP % 32
    == 0). Splits are whole tiles; with SPLIT_K > 1 float32 partials go to ``part_ptr``
    (SPLIT_K, M, N).
    With ``PDL`` (launched as a programmatic dependent) the first tile's weights, scales and
    zeros load while the grid before it still runs: only they come before the wait, since
    nothing else read or written here is the earlier grid's to finish."""
    S2: gl.constexpr = gl.SliceLayout(2, row_layout(BLOCK_N, NW))  # (BLOCK_N, C)
    if PDL:  # the kernel after this one may launch now (it waits for this one to finish)
        _gdc(False)
    pid_m, pid_k = gl.program_id(0), gl.program_id(2)
    offs_n = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    rows = gl.minimum(offs_n, N - 1)  # columns past N read row N - 1
    y = _rows_sum(x_ptr + pid_m * stride_xm, w_ptr, s_ptr, z_ptr, rows, stride_wn, stride_sn,
                  pid_k * k_per_split, k_per_split, magic, BLOCK_N, BLOCK_K, GROUP, NW,
                  PDL)  # fmt: skip
    n_ok = offs_n < N
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += gl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)
        gl.store(out_ptr + pid_m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        gl.store(part_ptr + (pid_k * M + pid_m) * N + offs_n, y, mask=n_ok)


def rows_ok(x: torch.Tensor, group: int, block_k: int) -> bool:
    """Whether ``_wq4_rows_kernel`` can take a call the word kernel could: a CUDA bfloat16 x
    (read as int32 pairs), chunks of 32 codes within a group, K tiles of whole chunks."""
    return x.is_cuda and x.dtype == torch.bfloat16 and group % 32 == 0 and block_k % 32 == 0


def launch_rows(grid: tuple[int, int, int], x: torch.Tensor, w: torch.Tensor, common: tuple,
                cfg: dict, group: int, split: int, has_bias: bool) -> None:  # fmt: skip
    """``_wq4_rows_kernel`` on ``wq_gemm.wq_linear_triton``'s ``common`` arguments (x, w,
    scale, zero, smooth, bias, out, part, M, N, K, the four strides, k_per_split)."""
    _wq4_rows_kernel[grid](
        x.view(torch.int32), w.view(torch.int32), common[2], common[3], *common[5:10],
        x.stride(0) // 2, w.stride(0) // 4, common[13], common[14], common[15], 0x43000000,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split, GROUP=group,
        NW=cfg["num_warps"], HAS_BIAS=has_bias, num_warps=cfg["num_warps"],
        **pdl.dependent_kwargs(x),
    )  # fmt: skip
