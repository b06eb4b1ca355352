"""Few-row int4 weight-only matmul on the tensor cores (Gluon, ``mma.sync`` m16n8k16 bf16):
sixteen weight rows are the A operand, up to eight x rows (tokens) the B operand.

Why: the one-row FMA kernel (``kiln.kernels.wq_gluon``) spends about 25 instructions per
32-bit word of codes (shifts, masks and one float FMA per code), and its time is about
its loads' plus its arithmetic's. Here a word costs seven integer instructions (three
shifts, four ``lop3``) and one ``mma``: the codes become bfloat16 ``128 + q`` pairs under
the exponent of 128 (exact), the tensor core multiplies them by x and sums in float32,
and per 128-code chunk ``scale * (acc - (128 + zero) * sum(x))`` restores the affine
code, with ``sum(x)`` from one more ``mma`` (ones times x) per chunk, shared by all rows.

Fragments (PTX ISA, ``mma.m16n8k16`` with .bf16): lane l = 4 g + t holds A[g][2t, 2t+1]
(a0), A[g + 8][2t, 2t+1] (a1), A[g][2t+8, 2t+9] (a2), A[g + 8][2t+8, 2t+9] (a3);
B[2t, 2t+1][g] (b0), B[2t+8, 2t+9][g] (b1); C[g][2t, 2t+1] (c0, c1), C[g + 8][..] (c2, c3).
The k order inside an mma is free as long as A and B agree, so each lane reads 16 bytes of
each of its two weight rows (words 4t..4t+3 of a 128-code chunk) in one load apiece and
uses the codes in the order ``lop3`` unpacks them: word j, half h gives a0 = codes
(2h, 2h+4), a2 = (2h+1, 2h+5), and b0/b1 hold x at those same k (two x pairs merged by
``prmt``). An earlier version with x as A and eight weight rows as B (two ``mma`` per
word, the A registers copied per ``mma``) was slower than the FMA kernel.

Gluon does not run in Triton's interpreter: the GPU tests check this kernel against
``wq_gemm.wq_linear_ref``."""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.errors import env_flag
from kiln.kernels import pdl
from kiln.kernels.partials import SplitPartials
from kiln.kernels.wq_config import MMA_CHUNK, MMA_MAX_M, mma_eligible, mma_token_tiles
from kiln.kernels.wq_gluon import _gdc
from kiln.kernels.wq_mma_ops import (  # noqa: F401 (_MMA, _halves, _step, _quad: re-exported)
    _MMA,
    _chunk,
    _halves,
    _mma,
    _pack2,
    _prmt,
    _quad,
    _step,
    _sub2,
    _words,
)

CHUNK = MMA_CHUNK
# KILN_WQ_MMA=0: MMA configurations take the default
ENABLED = env_flag(os.environ, "KILN_WQ_MMA", True)


@gluon.jit
def _ld(wp, k0, kw4, k_hi, TILED: gl.constexpr = False):
    """The (NW, R, 32, 4) words of each warp's chunk at code k0 + kw4 ((NW, 1, 1, 1), the
    warp's offset, already in ``wp``); zeros past ``k_hi``. ``TILED``: the words in
    ``wq_f16.tile_words``' order (a chunk's words 256 further)."""
    off = gl.multiple_of(k0 * 2, 16) if TILED else gl.multiple_of(k0 // 8, 16)
    return gl.load(wp + off, mask=k0 + kw4 < k_hi, other=0,
                   eviction_policy="evict_first")  # fmt: skip


@gluon.jit
def _acc(t, wa, wb, kx, kwx, ks, k_hi, xp, xg, M, x8, sa_p, sb_p, za_p, zb_p, magic, ones,
         GROUP: gl.constexpr, S: gl.constexpr, L: gl.constexpr, NT: gl.constexpr = 1,
         ZS: gl.constexpr = False):  # fmt: skip
    """``t`` (4 ``NT`` (NW, R, 32) float32 sums: four per tile of eight tokens) plus each
    warp's chunk at code kx + kwx (``kwx`` the warp's offset, already in ``xp``; ``ks`` the
    same codes as (NW, 1, 1)); nothing past ``k_hi`` (x reads 0). Token tile j reads x's
    rows ``x8`` j pairs further (rows xg + 8 j, masked by ``M``), all on the same weight
    fragments."""
    kin = kx + kwx < k_hi
    gi = gl.minimum(ks, k_hi - 1) // GROUP
    sa = gl.load(sa_p + gi).to(gl.float32)  # float32 or float16 scales
    sb = gl.load(sb_p + gi).to(gl.float32)
    za = gl.load(za_p + gi).to(gl.float32) + 128.0
    zb = gl.load(zb_p + gi).to(gl.float32) + 128.0
    out = _tile(t, 0, wa, wb, kx, kin, xp, xg, M, x8, sa, sb, za, zb, magic, ones, S, L, ZS)
    for j in gl.static_range(1, NT):
        out = out + _tile(t, j, wa, wb, kx, kin, xp, xg, M, x8, sa, sb, za, zb, magic, ones,
                          S, L, ZS)  # fmt: skip
    return out


@gluon.jit
def _tile(t, j: gl.constexpr, wa, wb, kx, kin, xp, xg, M, x8, sa, sb, za, zb, magic, ones,
          S: gl.constexpr, L: gl.constexpr, ZS: gl.constexpr = False):  # fmt: skip
    """Token tile ``j``'s four sums of ``t`` plus this chunk's, scaled per group."""
    u = gl.load(xp + j * x8 + gl.multiple_of(kx // 2, 16), mask=(xg + 8 * j < M) & kin, other=0)
    if ZS:  # the zero point is off the codes already (pure: one pair per chunk and row)
        c0, c1, c2, c3, s0, s1 = _chunk(wa, wb, u, magic, ones, S, L, _pack2(za), _pack2(zb),
                                        True)  # fmt: skip
        return (t[4 * j] + sa * c0, t[4 * j + 1] + sa * c1, t[4 * j + 2] + sb * c2,
                t[4 * j + 3] + sb * c3)  # fmt: skip
    c0, c1, c2, c3, s0, s1 = _chunk(wa, wb, u, magic, ones, S, L)
    e0 = gl.expand_dims(s0, 1)
    e1 = gl.expand_dims(s1, 1)
    return (t[4 * j] + sa * (c0 - za * e0), t[4 * j + 1] + sa * (c1 - za * e1),
            t[4 * j + 2] + sb * (c2 - zb * e0), t[4 * j + 3] + sb * (c3 - zb * e1))  # fmt: skip


@gluon.constexpr_function
def _words_layout(R, NW):
    """(NW, R, 32, 4): each lane's four words of its rows in each of R groups, a warp per
    chunk of K."""
    return gl.BlockedLayout([1, R, 1, 4], [1, 1, 32, 1], [NW, 1, 1, 1], [3, 2, 1, 0])


@gluon.jit
def _main(x_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_wn, stride_sn, k_per_split,
          magic, tile, tok0, R: gl.constexpr, GROUP: gl.constexpr, NW: gl.constexpr,
          CH: gl.constexpr, PF: gl.constexpr, PDL: gl.constexpr, NT: gl.constexpr = 1,
          ZS: gl.constexpr = False, TILED: gl.constexpr = False):  # fmt: skip
    """``_wq4_mma_kernel``'s work before its stores: weight tile ``tile`` (16 R rows) times
    x's rows tok0 .. tok0 + 8 NT - 1. Returns this program's 4 ``NT`` float32 sums (rows
    g / g + 8 by tokens tok0 + 8 j + 2t / + 2t + 1 for token tile j, each (NW, R, 32) over
    the warps' chunks), its rows (1, R, 32) and each lane's t (lane % 4); the epilogue is
    the caller's."""
    P: gl.constexpr = _words_layout(R, NW)
    S: gl.constexpr = gl.SliceLayout(3, P)  # (NW, R, 32): one element per lane and group
    L: gl.constexpr = gl.SliceLayout(1, S)  # (NW, 32): one per lane
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    if PDL:
        _gdc(False)
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(0, S)))
    g = lane // 4  # A's rows g and g + 8 of each group; B's token
    t = lane % 4
    grp = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(0, S)))
    row = gl.expand_dims(
        tile * (16 * R) + gl.expand_dims(grp, 1) * 16 + gl.expand_dims(g, 0), 0
    )  # fmt: skip  (1, R, 32): rows row, row + 8
    ra = gl.minimum(row, N - 1)
    rb = gl.minimum(row + 8, N - 1)
    wid = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, S)))
    kw = gl.expand_dims(gl.expand_dims(wid * 128, 1), 2)  # (NW, 1, 1): the warp's chunk offset
    w4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, P))))
    w4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(w4, 0), 1), 2)  # (1, 1, 1, 4)
    t4 = gl.expand_dims(gl.expand_dims(t * 4, 0), 0)
    kw4 = gl.expand_dims(kw, 3)
    if TILED:  # wq_f16.tile_words: 16-row tiles, a chunk's 16 rows x 16 words contiguous
        per_tile = (K // 128) * 256
        ba = (ra // 16).to(gl.int64) * per_tile + (ra % 16) * 16
        bb = (rb // 16).to(gl.int64) * per_tile + (rb % 16) * 16
        wpa = w_ptr + gl.expand_dims(ba + t4, 3) + (w4 + kw4 * 2)
        wpb = w_ptr + gl.expand_dims(bb + t4, 3) + (w4 + kw4 * 2)
    else:
        wpa = w_ptr + gl.expand_dims(ra.to(gl.int64) * stride_wn + t4, 3) + (w4 + kw4 // 8)
        wpb = w_ptr + gl.expand_dims(rb.to(gl.int64) * stride_wn + t4, 3) + (w4 + kw4 // 8)
    xl = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
    xg = gl.expand_dims(gl.expand_dims(tok0 + xl // 4, 0), 2)  # (1, 32, 1): the lane's token
    x16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
    xp = (x_ptr + xg * stride_xm + gl.expand_dims(gl.expand_dims((xl % 4) * 16, 0), 2)
          + gl.expand_dims(gl.expand_dims(x16, 0), 1))  # fmt: skip
    kwx = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))) * 128
    kwx = gl.expand_dims(gl.expand_dims(kwx, 1), 2)  # (NW, 1, 1): kw for x's layout
    xp = xp + kwx // 2
    ones = gl.full([NW, 32], 0x3F803F80, gl.int32, L)
    k_lo = gl.program_id(1) * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    sa_p = s_ptr + ra * stride_sn
    sb_p = s_ptr + rb * stride_sn
    za_p = z_ptr + ra * stride_sn
    zb_p = z_ptr + rb * stride_sn
    z0 = gl.zeros([NW, R, 32], gl.float32, S)
    acc = (z0, z0, z0, z0) * NT
    x8 = 8 * stride_xm  # from one token tile to the next
    STEP: gl.constexpr = 128 * NW * CH
    gl.static_assert(CH == 1 or CH == 2 or (CH == 4 and not PF), "CH: 1, 2, or 4 without PF")
    if PF:  # the first iteration's words, then each iteration loads the next one's
        na0 = _ld(wpa, k_lo, kw4, k_hi, TILED)
        nb0 = _ld(wpb, k_lo, kw4, k_hi, TILED)
        if CH == 2:
            na1 = _ld(wpa, k_lo + 128 * NW, kw4, k_hi, TILED)
            nb1 = _ld(wpb, k_lo + 128 * NW, kw4, k_hi, TILED)
        if PDL:
            _gdc(True)
    for k0 in range(k_lo, k_hi, STEP):
        if PF:
            a0, b0 = na0, nb0
            na0 = _ld(wpa, k0 + STEP, kw4, k_hi, TILED)
            nb0 = _ld(wpb, k0 + STEP, kw4, k_hi, TILED)
            if CH == 2:
                a1, b1 = na1, nb1
                na1 = _ld(wpa, k0 + STEP + 128 * NW, kw4, k_hi, TILED)
                nb1 = _ld(wpb, k0 + STEP + 128 * NW, kw4, k_hi, TILED)
        else:
            a0 = _ld(wpa, k0, kw4, k_hi, TILED)
            b0 = _ld(wpb, k0, kw4, k_hi, TILED)
            if CH >= 2:
                a1 = _ld(wpa, k0 + 128 * NW, kw4, k_hi, TILED)
                b1 = _ld(wpb, k0 + 128 * NW, kw4, k_hi, TILED)
            if CH == 4:
                a2 = _ld(wpa, k0 + 256 * NW, kw4, k_hi, TILED)
                b2 = _ld(wpb, k0 + 256 * NW, kw4, k_hi, TILED)
                a3 = _ld(wpa, k0 + 384 * NW, kw4, k_hi, TILED)
                b3 = _ld(wpb, k0 + 384 * NW, kw4, k_hi, TILED)
            if PDL:  # noqa: SIM102 (compile-time, then run-time): the first words, then wait
                if k0 == k_lo:
                    _gdc(True)
        acc = _acc(acc, a0, b0, k0, kwx, k0 + kw, k_hi, xp, xg, M, x8, sa_p, sb_p,
                   za_p, zb_p, magic, ones, GROUP, S, L, NT, ZS)  # fmt: skip
        if CH >= 2:
            k1 = k0 + 128 * NW
            acc = _acc(acc, a1, b1, k1, kwx, k1 + kw, k_hi, xp, xg, M, x8, sa_p,
                       sb_p, za_p, zb_p, magic, ones, GROUP, S, L, NT, ZS)  # fmt: skip
        if CH == 4:
            k2 = k0 + 256 * NW
            acc = _acc(acc, a2, b2, k2, kwx, k2 + kw, k_hi, xp, xg, M, x8, sa_p,
                       sb_p, za_p, zb_p, magic, ones, GROUP, S, L, NT, ZS)  # fmt: skip
            k3 = k0 + 384 * NW
            acc = _acc(acc, a3, b3, k3, kwx, k3 + kw, k_hi, xp, xg, M, x8, sa_p,
                       sb_p, za_p, zb_p, magic, ones, GROUP, S, L, NT, ZS)  # fmt: skip
    return acc, row, t


@gluon.jit
def _wq4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_om, k_per_split, magic, MB,
                    R: gl.constexpr, SPLIT_K: gl.constexpr, GROUP: gl.constexpr,
                    NW: gl.constexpr, HAS_BIAS: gl.constexpr, CH: gl.constexpr = 1,
                    PF: gl.constexpr = False, PDL: gl.constexpr = False,
                    NT: gl.constexpr = 1, ZS: gl.constexpr = False,
                    TILED: gl.constexpr = False):  # fmt: skip
    """Grid (N / (16 R) * MB, SPLIT_K): program p takes weight tile p // MB and x's rows
    8 NT (p % MB) onwards, 8 ``NT`` of them (NT token tiles of eight on the same weight
    fragments; ``MB`` blocks of rows, adjacent programs on the same weights so that the
    second block's reads come from L2). x: bfloat16 rows as int32 pairs
    (stride in pairs); w: (N, K/8) int32 words (stride in words); scale float32 or float16, zero
    uint8 (N, K/GROUP), GROUP % 128 == 0; k_per_split % 128 == 0; ``magic`` 0x43004300.
    A program takes R groups of sixteen weight rows; its NW warps take alternate chunks of
    its K range and sum at the end; with SPLIT_K > 1 float32 partials go to ``part_ptr``
    (SPLIT_K, M, N). Each iteration takes CH (1, 2 or 4) chunks per warp; with ``PF`` (CH
    1 or 2) it loads the next iteration's words before its arithmetic (a double buffer).
    ``PDL``: as in ``wq_gluon._wq4_rows_kernel``. ``ZS``: the zero point taken off the codes
    (``sub.bf16x2``) in place of the sum(x) ``mma``. ``TILED``: w in
    ``wq_f16.tile_words``' order (N a multiple of 16)."""
    pid = gl.program_id(0)
    tok0 = (pid % MB) * (8 * NT)
    acc, row, t = _main(x_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                        k_per_split, magic, pid // MB, tok0, R, GROUP, NW, CH, PF, PDL,
                        NT, ZS, TILED)  # fmt: skip
    S: gl.constexpr = gl.SliceLayout(3, _words_layout(R, NW))
    tok = gl.expand_dims(tok0 + 2 * t, 0)  # (1, 32)
    rw = gl.reshape(row, [R, 32])
    rw = gl.convert_layout(rw, gl.SliceLayout(0, S))
    for j in gl.static_range(NT):  # token tile j: tokens tok0 + 8 j ..
        tj = tok + 8 * j
        _store(gl.sum(acc[4 * j], axis=0), rw, tj, b_ptr, out_ptr, part_ptr, M, N, stride_om,
               SPLIT_K, HAS_BIAS)  # fmt: skip
        _store(gl.sum(acc[4 * j + 1], axis=0), rw, tj + 1, b_ptr, out_ptr, part_ptr, M, N,
               stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip
        _store(gl.sum(acc[4 * j + 2], axis=0), rw + 8, tj, b_ptr, out_ptr, part_ptr, M, N,
               stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip
        _store(gl.sum(acc[4 * j + 3], axis=0), rw + 8, tj + 1, b_ptr, out_ptr, part_ptr, M, N,
               stride_om, SPLIT_K, HAS_BIAS)  # fmt: skip


@gluon.jit
def _store(y, n, tok, b_ptr, out_ptr, part_ptr, M, N, stride_om, SPLIT_K: gl.constexpr,
           HAS_BIAS: gl.constexpr):  # fmt: skip
    """Row ``n`` of token ``tok``: the output, or this split's partial."""
    ok = (tok < M) & (n < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += gl.load(b_ptr + n, mask=ok, other=0.0).to(gl.float32)
        gl.store(out_ptr + tok * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        gl.store(part_ptr + (gl.program_id(1) * M + tok) * N + n, y, mask=ok)


def mma_ok(x: torch.Tensor, k: int, group: int, smooth: torch.Tensor | None) -> bool:
    """Whether ``_wq4_mma_kernel`` takes the call: a CUDA bfloat16 x of at most
    ``wq_config.mma_rows()`` rows, whole 128-code chunks, groups of whole chunks, no
    smoothing."""
    return (
        mma_eligible(k, x.shape[0], group) and x.is_cuda and x.dtype == torch.bfloat16
        and smooth is None and x.stride(0) % 2 == 0 and x.storage_offset() % 2 == 0
        and x.stride(1) == 1
    )  # fmt: skip


def wq4_mma(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            bias: torch.Tensor | None = None, r: int = 2, num_warps: int = 1,
            split: int = 1, ch: int = 1, pf: bool = False, out: torch.Tensor | None = None,
            partials: bool = False, nt: int | None = None,
            zs: bool = False, tiled: bool = False) -> torch.Tensor | SplitPartials:  # fmt: skip
    """(M, N) = x @ dequantized(w).T (+ bias) in x's dtype; ``scale`` float32 or float16. Splits of
    whole chunks; split > 1 adds ``gemv.split_k_reduce``, or with ``partials`` (and no
    bias) returns the partials for the consumer to add (``kiln.kernels.partials``).
    A program takes up to ``nt`` token tiles of eight (``wq_config.mma_token_tiles``);
    more rows run in blocks of 8 ``nt``, on the grid's first axis beside their weights.
    ``zs``: the zero point subtracted from the codes instead of the sum(x) ``mma``.
    ``tiled``: w in ``wq_f16.tile_words``' order."""
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
    nt = mma_token_tiles(m, nt, r, ch)
    blocks = triton.cdiv(m, MMA_MAX_M * nt)
    grid = (triton.cdiv(n, 16 * r) * blocks, split)
    _wq4_mma_kernel[grid](
        x.view(torch.int32), w.view(torch.int32), scale, zero, bias if bias is not None else out,
        out, part, m, n, k, x.stride(0) // 2, w.stride(0) // 4, scale.stride(0), out.stride(0),
        k_per_split, 0x43004300, blocks, R=r, SPLIT_K=split, GROUP=group, NW=num_warps, CH=ch,
        PF=pf, NT=nt, HAS_BIAS=bias is not None, num_warps=num_warps,
        **({"ZS": True} if zs else {}),
        **({"TILED": True} if tiled else {}),
        **pdl.dependent_kwargs(x),
    )  # fmt: skip
    if split > 1:
        if partials and bias is None:
            return SplitPartials(part, x.dtype)
        split_k_reduce(part, out, bias)
    return out
