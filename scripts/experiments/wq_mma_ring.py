"""Frozen copy for ``int4_gap.py`` (2026-12-02): ``kiln/kernels/wq_mma.py`` at 1034885 with
three experimental levers, none adopted: ``WCM`` (the words' loads' cache modifier),
``stride_sg`` (scales and zeros in either layout), ``ST`` (the words streamed by
``cp.async`` through a ring of ST shared-memory slots, ``_ring``) and ``TL`` (the words in
``tile_words`` order); and two diagnostics in ``WCM`` with wrong results by design:
"nomath" (the words loaded and folded, no x, scales or arithmetic) and "noload" (x,
scales and zeros constant, the arithmetic kept); then "nosum" (no sum(x) ``mma``),
"noprmt" (x's pairs used as loaded), "lean" (both) and "nosz" (scales and zeros
constant, x loaded). The engine's kernel is
``kiln.kernels.wq_mma``.

Few-row int4 weight-only matmul on the tensor cores (Gluon, ``mma.sync`` m16n8k16 bf16):
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
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from kiln.kernels import pdl
from kiln.kernels.partials import SplitPartials
from kiln.kernels.wq_config import MMA_CHUNK, MMA_MAX_M, mma_eligible, mma_token_tiles
from kiln.kernels.wq_gluon import _gdc

CHUNK = MMA_CHUNK
ENABLED = os.environ.get("KILN_WQ_MMA", "1") != "0"  # 0: MMA configurations take the default
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
def _prmt(ua, ub):
    """x's pairs u[i], u[i + 2] -> b0 = (lo ua, lo ub), b1 = (hi ua, hi ub)."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;", "=r,=r,r,r", [ua, ub],
        dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _sub2(a, z2):
    """bfloat16 pairs a - z2 (``128 + q`` minus ``128 + zero``: q - zero, exact)."""
    return gl.inline_asm_elementwise(
        "sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, z2], dtype=gl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _pack2(v):
    """float32 v (exact in bfloat16) -> the bfloat16 pair (v, v) as int32."""
    return gl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f", [v], dtype=gl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _halves(v):
    """(NW, 32, 2n) -> its even and odd elements along the last axis (registers only)."""
    return gl.split(gl.reshape(v, [v.shape[0], v.shape[1], v.shape[2] // 2, 2]))


@gluon.jit
def _step(c, s, wa, wb, ua, ub, h: gl.constexpr, magic, ones, za2, zb2, ZS: gl.constexpr,
          DG: gl.constexpr = ""):  # fmt: skip
    """One mma step (16 codes of each row): word half ``h`` of rows g (wa) and g + 8 (wb),
    (NW, R, 32); x's pairs ``ua`` = u[4j + h], ``ub`` = u[4j + h + 2], (NW, 32); c and s:
    the rows' and x's accumulators. ``ZS``: the rows' ``128 + zero`` pairs (za2, zb2)
    are taken off the codes here, so that c sums (q - zero) x and s is not needed."""
    if DG == "noprmt" or DG == "lean":  # diagnostic: x's pairs as loaded (wrong k order)
        b0, b1 = ua, ub
    else:
        b0, b1 = _prmt(ua, ub)
    if ZS or DG == "nosum" or DG == "lean":  # diagnostic: no sum(x) mma
        s0, s1, s2, s3 = s[0], s[1], s[2], s[3]
    else:
        s0, s1, s2, s3 = _mma(ones, ones, ones, ones, b0, b1, s[0], s[1], s[2], s[3])
    a0 = ((wa >> (8 * h)) & 0x000F000F) | magic
    a2 = ((wa >> (8 * h + 4)) & 0x000F000F) | magic
    a1 = ((wb >> (8 * h)) & 0x000F000F) | magic
    a3 = ((wb >> (8 * h + 4)) & 0x000F000F) | magic
    if ZS:
        a0 = _sub2(a0, za2)
        a2 = _sub2(a2, za2)
        a1 = _sub2(a1, zb2)
        a3 = _sub2(a3, zb2)
    e0 = gl.expand_dims(b0, 1)
    e1 = gl.expand_dims(b1, 1)
    c0, c1, c2, c3 = _mma(a0, a1, a2, a3, e0, e1, c[0], c[1], c[2], c[3])
    return (c0, c1, c2, c3), (s0, s1, s2, s3)


@gluon.jit
def _words(wd, S: gl.constexpr):
    """(NW, R, 32, 4) -> its four words, (NW, R, 32) each in ``S``."""
    w01, w23 = gl.split(gl.reshape(wd, [wd.shape[0], wd.shape[1], wd.shape[2], 2, 2]))
    w0, w2 = gl.split(w01)
    w1, w3 = gl.split(w23)
    return (gl.convert_layout(w0, S), gl.convert_layout(w1, S), gl.convert_layout(w2, S),
            gl.convert_layout(w3, S))  # fmt: skip


@gluon.jit
def _quad(v, L: gl.constexpr):
    """(NW, 32, 4) holding u[i], u[i + 4], u[i + 8], u[i + 12] -> the four, in ``L``."""
    p, q = _halves(v)  # p: u i, i + 8; q: u i + 4, i + 12
    v0, v8 = gl.split(p)
    v4, v12 = gl.split(q)
    return (gl.convert_layout(v0, L), gl.convert_layout(v4, L), gl.convert_layout(v8, L),
            gl.convert_layout(v12, L))  # fmt: skip


@gluon.jit
def _chunk(wa, wb, u, magic, ones, S: gl.constexpr, L: gl.constexpr, za2=None, zb2=None,
           ZS: gl.constexpr = False, DG: gl.constexpr = ""):  # fmt: skip
    """One 128-code chunk per warp: float32 sums of (128 + q) x for rows g, g + 8 and
    tokens 2t, 2t + 1 (c0..c3, (NW, R, 32)) and x's sums for tokens 2t, 2t + 1 (s0, s1,
    (NW, 32)). wa, wb: (NW, R, 32, 4) words of rows g, g + 8; u: (NW, 32, 16) x pairs."""
    g0, g1, g2, g3 = _words(wa, S)  # row g's words 0..3
    h0, h1, h2, h3 = _words(wb, S)  # row g + 8's
    e, o = _halves(u)
    ee, eo = _halves(e)
    oe, oo = _halves(o)
    u0, u4, u8, u12 = _quad(ee, L)
    u2, u6, u10, u14 = _quad(eo, L)
    u1, u5, u9, u13 = _quad(oe, L)
    u3, u7, u11, u15 = _quad(oo, L)
    z2 = gl.zeros(g0.shape, gl.float32, S)
    c = (z2, z2, z2, z2)
    z1 = gl.zeros(u0.shape, gl.float32, L)
    s = (z1, z1, z1, z1)
    c, s = _step(c, s, g0, h0, u0, u2, 0, magic, ones, za2, zb2, ZS, DG)
    c, s = _step(c, s, g0, h0, u1, u3, 1, magic, ones, za2, zb2, ZS, DG)
    c, s = _step(c, s, g1, h1, u4, u6, 0, magic, ones, za2, zb2, ZS, DG)
    c, s = _step(c, s, g1, h1, u5, u7, 1, magic, ones, za2, zb2, ZS, DG)
    c, s = _step(c, s, g2, h2, u8, u10, 0, magic, ones, za2, zb2, ZS, DG)
    c, s = _step(c, s, g2, h2, u9, u11, 1, magic, ones, za2, zb2, ZS, DG)
    c, s = _step(c, s, g3, h3, u12, u14, 0, magic, ones, za2, zb2, ZS, DG)
    c, s = _step(c, s, g3, h3, u13, u15, 1, magic, ones, za2, zb2, ZS, DG)
    return c[0], c[1], c[2], c[3], s[0], s[1]


@gluon.jit
def _ld(wp, k0, kw4, k_hi, WCM: gl.constexpr = "", TL: gl.constexpr = False):
    """The (NW, R, 32, 4) words of each warp's chunk at code k0 + kw4 ((NW, 1, 1, 1), the
    warp's offset, already in ``wp``); zeros past ``k_hi``. ``WCM``: the loads' cache
    modifier ("" the default, ".cg" past L1). ``TL``: the words in ``tile_words`` order
    (a chunk of a 16-row tile is 256 words on)."""
    off = gl.multiple_of(k0 * 2, 16) if TL else gl.multiple_of(k0 // 8, 16)
    if WCM == ".cg":  # ptxas takes no eviction policy beside .cg
        return gl.load(wp + off, mask=k0 + kw4 < k_hi, other=0, cache_modifier=WCM)
    else:  # the diagnostics load as usual
        return gl.load(wp + off, mask=k0 + kw4 < k_hi, other=0,
                       eviction_policy="evict_first")  # fmt: skip


@gluon.jit
def _acc(t, wa, wb, kx, kwx, ks, k_hi, xp, xg, M, x8, sa_p, sb_p, za_p, zb_p, sg, magic,
         ones, GROUP: gl.constexpr, S: gl.constexpr, L: gl.constexpr, NT: gl.constexpr = 1,
         ZS: gl.constexpr = False, WCM: gl.constexpr = ""):  # fmt: skip
    """``t`` (4 ``NT`` (NW, R, 32) float32 sums: four per tile of eight tokens) plus each
    warp's chunk at code kx + kwx (``kwx`` the warp's offset, already in ``xp``; ``ks`` the
    same codes as (NW, 1, 1)); nothing past ``k_hi`` (x reads 0); ``sg``: the scales' and
    zeros' stride from one group to the next. Token tile j reads x's
    rows ``x8`` j pairs further (rows xg + 8 j, masked by ``M``), all on the same weight
    fragments."""
    if WCM == "nomath":  # diagnostic (one token tile): the words folded, nothing else
        return (t[0] + gl.sum((wa ^ wb).to(gl.float32), axis=3), t[1], t[2], t[3])
    if WCM == "noload":  # diagnostic (one token tile): constant x, scales and zeros
        u = gl.load(xp, mask=xg < 0, other=0x3F803F80)  # predicated off: no memory access
        return _tile_u(t, 0, wa, wb, u, 1.0, 1.0, 136.0, 136.0, magic, ones, S, L, WCM)
    kin = kx + kwx < k_hi
    if WCM == "nosz":  # diagnostic (one token tile): x loaded, scales and zeros constant
        u = gl.load(xp + gl.multiple_of(kx // 2, 16), mask=(xg < M) & kin, other=0)
        return _tile_u(t, 0, wa, wb, u, 1.0, 1.0, 136.0, 136.0, magic, ones, S, L, WCM)
    gi = gl.minimum(ks, k_hi - 1) // GROUP * sg
    sa = gl.load(sa_p + gi)
    sb = gl.load(sb_p + gi)
    za = gl.load(za_p + gi).to(gl.float32) + 128.0
    zb = gl.load(zb_p + gi).to(gl.float32) + 128.0
    # _step reads the diagnostics "nosum", "noprmt" and "lean" in WCM
    out = _tile(t, 0, wa, wb, kx, kin, xp, xg, M, x8, sa, sb, za, zb, magic, ones, S, L, ZS,
                WCM)  # fmt: skip
    for j in gl.static_range(1, NT):
        out = out + _tile(t, j, wa, wb, kx, kin, xp, xg, M, x8, sa, sb, za, zb, magic, ones,
                          S, L, ZS, WCM)  # fmt: skip
    return out


@gluon.jit
def _tile(t, j: gl.constexpr, wa, wb, kx, kin, xp, xg, M, x8, sa, sb, za, zb, magic, ones,
          S: gl.constexpr, L: gl.constexpr, ZS: gl.constexpr = False,
          DG: gl.constexpr = ""):  # fmt: skip
    """Token tile ``j``'s four sums of ``t`` plus this chunk's, scaled per group."""
    u = gl.load(xp + j * x8 + gl.multiple_of(kx // 2, 16), mask=(xg + 8 * j < M) & kin, other=0)
    if ZS:  # the zero point is off the codes already (pure: one pair per chunk and row)
        c0, c1, c2, c3, _s0, _s1 = _chunk(wa, wb, u, magic, ones, S, L, _pack2(za), _pack2(zb),
                                        True, DG)  # fmt: skip
        return (t[4 * j] + sa * c0, t[4 * j + 1] + sa * c1, t[4 * j + 2] + sb * c2,
                t[4 * j + 3] + sb * c3)  # fmt: skip
    return _tile_u(t, j, wa, wb, u, sa, sb, za, zb, magic, ones, S, L, DG)


@gluon.jit
def _tile_u(t, j: gl.constexpr, wa, wb, u, sa, sb, za, zb, magic, ones, S: gl.constexpr,
            L: gl.constexpr, DG: gl.constexpr = ""):  # fmt: skip
    """``_tile``'s arithmetic on x's pairs ``u`` already loaded."""
    c0, c1, c2, c3, s0, s1 = _chunk(wa, wb, u, magic, ones, S, L, DG=DG)
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
def _main(x_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sg,
          k_per_split, magic, tile, tok0, R: gl.constexpr, GROUP: gl.constexpr,
          NW: gl.constexpr, CH: gl.constexpr, PF: gl.constexpr, PDL: gl.constexpr,
          NT: gl.constexpr = 1, ZS: gl.constexpr = False,
          WCM: gl.constexpr = "", ST: gl.constexpr = 0,
          TL: gl.constexpr = False):  # fmt: skip
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
    if TL:  # (N / 16, K / 128, 16, 16) words: each chunk of a 16-row tile contiguous
        gl.static_assert(ST == 0, "TL: the register loop only")
        wpa = w_ptr + gl.expand_dims((ra // 16).to(gl.int64) * (16 * stride_wn)
                                     + (ra % 16) * 16 + t4, 3) + (w4 + kw4 * 2)  # fmt: skip
        wpb = w_ptr + gl.expand_dims((rb // 16).to(gl.int64) * (16 * stride_wn)
                                     + (rb % 16) * 16 + t4, 3) + (w4 + kw4 * 2)  # fmt: skip
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
    gl.static_assert(CH == 1 or CH == 2 or (CH == 4 and not PF), "CH: 1, 2, or 4 without PF")
    if ST > 0:
        acc = _ring(acc, wpa, wpb, k_lo, k_hi, kw, kw4, kwx, xp, xg, M, x8, sa_p, sb_p, za_p,
                    zb_p, stride_sg, magic, ones, P, R, GROUP, NW, CH, PF, PDL, NT, ZS, ST,
                    S, L)  # fmt: skip
    elif WCM == "px":
        acc = _regs_px(acc, wpa, wpb, k_lo, k_hi, kw, kw4, kwx, xp, xg, M, sa_p, sb_p, za_p,
                       zb_p, stride_sg, magic, ones, GROUP, NW, CH, PDL, NT, WCM, S,
                       L)  # fmt: skip
    else:
        acc = _regs(acc, wpa, wpb, k_lo, k_hi, kw, kw4, kwx, xp, xg, M, x8, sa_p, sb_p, za_p,
                    zb_p, stride_sg, magic, ones, GROUP, NW, CH, PF, PDL, NT, ZS, WCM, S,
                    L, TL)  # fmt: skip
    return acc, row, t


@gluon.jit
def _ring(acc, wpa, wpb, k_lo, k_hi, kw, kw4, kwx, xp, xg, M, x8, sa_p, sb_p, za_p, zb_p,
          stride_sg, magic, ones, P: gl.constexpr, R: gl.constexpr, GROUP: gl.constexpr,
          NW: gl.constexpr, CH: gl.constexpr, PF: gl.constexpr, PDL: gl.constexpr,
          NT: gl.constexpr, ZS: gl.constexpr, ST: gl.constexpr, S: gl.constexpr,
          L: gl.constexpr):  # fmt: skip
    """``_main``'s loop with the words streamed by ``cp.async`` through a ring of ``ST``
    slots in shared memory, one chunk a warp per step: ST - 1 steps' words in flight
    without registers held for them. Each thread reads back only the words it copied,
    so ``wait_group`` alone orders copy and read (no barrier)."""
    gl.static_assert(CH == 1 and not PF, "ST: one chunk a step, no register prefetch")
    SL: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [3, 2, 1, 0])
    sa_w = gl.allocate_shared_memory(gl.int32, [ST, NW, R, 32, 4], SL)
    sb_w = gl.allocate_shared_memory(gl.int32, [ST, NW, R, 32, 4], SL)
    STEP: gl.constexpr = 128 * NW
    n = gl.cdiv(k_hi - k_lo, STEP)
    for i in gl.static_range(ST - 1):  # the ring's first slots
        _ring_copy(sa_w, sb_w, wpa, wpb, k_lo + i * STEP, kw4, k_hi, i % ST)
        async_copy.commit_group()
    if PDL:
        _gdc(True)
    for i in range(n):
        k0 = k_lo + i * STEP
        # the slot read at step i - 1, by this very thread
        _ring_copy(sa_w, sb_w, wpa, wpb, k0 + (ST - 1) * STEP, kw4, k_hi, (i + ST - 1) % ST)
        async_copy.commit_group()
        async_copy.wait_group(ST - 1)  # step i's words have landed
        a0 = sa_w.index(i % ST).load(P)
        b0 = sb_w.index(i % ST).load(P)
        acc = _acc(acc, a0, b0, k0, kwx, k0 + kw, k_hi, xp, xg, M, x8, sa_p, sb_p,
                   za_p, zb_p, stride_sg, magic, ones, GROUP, S, L, NT, ZS)  # fmt: skip
    async_copy.wait_group(0)
    return acc


@gluon.jit
def _ring_copy(sa_w, sb_w, wpa, wpb, k0, kw4, k_hi, slot):
    """Start the copy of the words at code k0 (zeros past ``k_hi``) into ring slot ``slot``."""
    m = k0 + kw4 < k_hi
    off = gl.multiple_of(k0 // 8, 16)
    async_copy.async_copy_global_to_shared(sa_w.index(slot), wpa + off, mask=m,
                                           eviction_policy="evict_first")  # fmt: skip
    async_copy.async_copy_global_to_shared(sb_w.index(slot), wpb + off, mask=m,
                                           eviction_policy="evict_first")  # fmt: skip


@gluon.jit
def _side(kx, kwx, ks, k_hi, xp, xg, M, sa_p, sb_p, za_p, zb_p, sg, GROUP: gl.constexpr):
    """x's pairs, the rows' scales and ``128 + zero`` for each warp's chunk at kx + kwx."""
    gi = gl.minimum(ks, k_hi - 1) // GROUP * sg
    u = gl.load(xp + gl.multiple_of(kx // 2, 16), mask=(xg < M) & (kx + kwx < k_hi), other=0)
    return (u, gl.load(sa_p + gi), gl.load(sb_p + gi),
            gl.load(za_p + gi).to(gl.float32) + 128.0,
            gl.load(zb_p + gi).to(gl.float32) + 128.0)  # fmt: skip


@gluon.jit
def _regs_px(acc, wpa, wpb, k_lo, k_hi, kw, kw4, kwx, xp, xg, M, sa_p, sb_p, za_p, zb_p,
             sg, magic, ones, GROUP: gl.constexpr, NW: gl.constexpr, CH: gl.constexpr,
             PDL: gl.constexpr, NT: gl.constexpr, WCM: gl.constexpr, S: gl.constexpr,
             L: gl.constexpr):  # fmt: skip
    """Lever "px": ``_regs`` with PF where x's pairs, scales and zeros are loaded one
    iteration ahead with the words (one token tile, CH 1 or 2)."""
    gl.static_assert(NT == 1 and (CH == 1 or CH == 2), "px: one token tile, CH 1 or 2")
    STEP: gl.constexpr = 128 * NW * CH
    C1: gl.constexpr = 128 * NW
    na0 = _ld(wpa, k_lo, kw4, k_hi, WCM)
    nb0 = _ld(wpb, k_lo, kw4, k_hi, WCM)
    if CH == 2:
        na1 = _ld(wpa, k_lo + C1, kw4, k_hi, WCM)
        nb1 = _ld(wpb, k_lo + C1, kw4, k_hi, WCM)
    if PDL:
        _gdc(True)
    nu0, nsa0, nsb0, nza0, nzb0 = _side(k_lo, kwx, k_lo + kw, k_hi, xp, xg, M, sa_p, sb_p,
                                        za_p, zb_p, sg, GROUP)  # fmt: skip
    if CH == 2:
        nu1, nsa1, nsb1, nza1, nzb1 = _side(k_lo + C1, kwx, k_lo + C1 + kw, k_hi, xp, xg, M,
                                            sa_p, sb_p, za_p, zb_p, sg, GROUP)  # fmt: skip
    for k0 in range(k_lo, k_hi, STEP):
        a0, b0, u0, sa0, sb0, za0, zb0 = na0, nb0, nu0, nsa0, nsb0, nza0, nzb0
        kn = k0 + STEP
        na0 = _ld(wpa, kn, kw4, k_hi, WCM)
        nb0 = _ld(wpb, kn, kw4, k_hi, WCM)
        nu0, nsa0, nsb0, nza0, nzb0 = _side(kn, kwx, kn + kw, k_hi, xp, xg, M, sa_p, sb_p,
                                            za_p, zb_p, sg, GROUP)  # fmt: skip
        if CH == 2:
            a1, b1, u1, sa1, sb1, za1, zb1 = na1, nb1, nu1, nsa1, nsb1, nza1, nzb1
            na1 = _ld(wpa, kn + C1, kw4, k_hi, WCM)
            nb1 = _ld(wpb, kn + C1, kw4, k_hi, WCM)
            nu1, nsa1, nsb1, nza1, nzb1 = _side(kn + C1, kwx, kn + C1 + kw, k_hi, xp, xg, M,
                                                sa_p, sb_p, za_p, zb_p, sg, GROUP)  # fmt: skip
        acc = _tile_u(acc, 0, a0, b0, u0, sa0, sb0, za0, zb0, magic, ones, S, L, WCM)
        if CH == 2:
            acc = _tile_u(acc, 0, a1, b1, u1, sa1, sb1, za1, zb1, magic, ones, S, L, WCM)
    return acc


@gluon.jit
def _regs(acc, wpa, wpb, k_lo, k_hi, kw, kw4, kwx, xp, xg, M, x8, sa_p, sb_p, za_p, zb_p,
          stride_sg, magic, ones, GROUP: gl.constexpr, NW: gl.constexpr, CH: gl.constexpr,
          PF: gl.constexpr, PDL: gl.constexpr, NT: gl.constexpr, ZS: gl.constexpr,
          WCM: gl.constexpr, S: gl.constexpr, L: gl.constexpr,
          TL: gl.constexpr = False):  # fmt: skip
    """``_main``'s loop with the words loaded into registers, CH chunks a warp per step
    (with ``PF`` the next step's loaded before this one's arithmetic)."""
    STEP: gl.constexpr = 128 * NW * CH
    if PF:  # the first iteration's words, then each iteration loads the next one's
        na0 = _ld(wpa, k_lo, kw4, k_hi, WCM, TL)
        nb0 = _ld(wpb, k_lo, kw4, k_hi, WCM, TL)
        if CH == 2:
            na1 = _ld(wpa, k_lo + 128 * NW, kw4, k_hi, WCM, TL)
            nb1 = _ld(wpb, k_lo + 128 * NW, kw4, k_hi, WCM, TL)
        if PDL:
            _gdc(True)
    for k0 in range(k_lo, k_hi, STEP):
        if PF:
            a0, b0 = na0, nb0
            na0 = _ld(wpa, k0 + STEP, kw4, k_hi, WCM, TL)
            nb0 = _ld(wpb, k0 + STEP, kw4, k_hi, WCM, TL)
            if CH == 2:
                a1, b1 = na1, nb1
                na1 = _ld(wpa, k0 + STEP + 128 * NW, kw4, k_hi, WCM, TL)
                nb1 = _ld(wpb, k0 + STEP + 128 * NW, kw4, k_hi, WCM, TL)
        else:
            a0 = _ld(wpa, k0, kw4, k_hi, WCM, TL)
            b0 = _ld(wpb, k0, kw4, k_hi, WCM, TL)
            if CH >= 2:
                a1 = _ld(wpa, k0 + 128 * NW, kw4, k_hi, WCM, TL)
                b1 = _ld(wpb, k0 + 128 * NW, kw4, k_hi, WCM, TL)
            if CH == 4:
                a2 = _ld(wpa, k0 + 256 * NW, kw4, k_hi, WCM, TL)
                b2 = _ld(wpb, k0 + 256 * NW, kw4, k_hi, WCM, TL)
                a3 = _ld(wpa, k0 + 384 * NW, kw4, k_hi, WCM, TL)
                b3 = _ld(wpb, k0 + 384 * NW, kw4, k_hi, WCM, TL)
            if PDL:  # noqa: SIM102 (compile-time, then run-time): the first words, then wait
                if k0 == k_lo:
                    _gdc(True)
        acc = _acc(acc, a0, b0, k0, kwx, k0 + kw, k_hi, xp, xg, M, x8, sa_p, sb_p,
                   za_p, zb_p, stride_sg, magic, ones, GROUP, S, L, NT, ZS, WCM)  # fmt: skip
        if CH >= 2:
            k1 = k0 + 128 * NW
            acc = _acc(acc, a1, b1, k1, kwx, k1 + kw, k_hi, xp, xg, M, x8, sa_p,
                       sb_p, za_p, zb_p, stride_sg, magic, ones, GROUP, S, L, NT, ZS,
                       WCM)  # fmt: skip
        if CH == 4:
            k2 = k0 + 256 * NW
            acc = _acc(acc, a2, b2, k2, kwx, k2 + kw, k_hi, xp, xg, M, x8, sa_p,
                       sb_p, za_p, zb_p, stride_sg, magic, ones, GROUP, S, L, NT, ZS,
                       WCM)  # fmt: skip
            k3 = k0 + 384 * NW
            acc = _acc(acc, a3, b3, k3, kwx, k3 + kw, k_hi, xp, xg, M, x8, sa_p,
                       sb_p, za_p, zb_p, stride_sg, magic, ones, GROUP, S, L, NT, ZS,
                       WCM)  # fmt: skip
    return acc


@gluon.jit
def _wq4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_sg, stride_om, k_per_split, magic,
                    MB, R: gl.constexpr, SPLIT_K: gl.constexpr, GROUP: gl.constexpr,
                    NW: gl.constexpr, HAS_BIAS: gl.constexpr, CH: gl.constexpr = 1,
                    PF: gl.constexpr = False, PDL: gl.constexpr = False,
                    NT: gl.constexpr = 1, ZS: gl.constexpr = False,
                    WCM: gl.constexpr = "", ST: gl.constexpr = 0,
                    TL: gl.constexpr = False):  # fmt: skip
    """Grid (N / (16 R) * MB, SPLIT_K): program p takes weight tile p // MB and x's rows
    8 NT (p % MB) onwards, 8 ``NT`` of them (NT token tiles of eight on the same weight
    fragments; ``MB`` blocks of rows, adjacent programs on the same weights so that the
    second block's reads come from L2). x: bfloat16 rows as int32 pairs
    (stride in pairs); w: (N, K/8) int32 words (stride in words); scale float32, zero
    uint8 (N, K/GROUP), GROUP % 128 == 0; k_per_split % 128 == 0; ``magic`` 0x43004300.
    A program takes R groups of sixteen weight rows; its NW warps take alternate chunks of
    its K range and sum at the end; with SPLIT_K > 1 float32 partials go to ``part_ptr``
    (SPLIT_K, M, N). Each iteration takes CH (1, 2 or 4) chunks per warp; with ``PF`` (CH
    1 or 2) it loads the next iteration's words before its arithmetic (a double buffer).
    ``PDL``: as in ``wq_gluon._wq4_rows_kernel``. ``ZS``: the zero point taken off the codes
    (``sub.bf16x2``) in place of the sum(x) ``mma``. Scales and zeros share their strides
    (row ``stride_sn``, group ``stride_sg``: either layout). ``WCM``: the words' loads'
    cache modifier."""
    pid = gl.program_id(0)
    tok0 = (pid % MB) * (8 * NT)
    acc, row, t = _main(x_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                        stride_sg, k_per_split, magic, pid // MB, tok0, R, GROUP, NW, CH, PF,
                        PDL, NT, ZS, WCM, ST, TL)  # fmt: skip
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
            zs: bool = False, wcm: str = "",
            st: int = 0, tiled: bool = False) -> torch.Tensor | SplitPartials:  # fmt: skip
    """(M, N) = x @ dequantized(w).T (+ bias) in x's dtype; ``scale`` float32. Splits of
    whole chunks; split > 1 adds ``gemv.split_k_reduce``, or with ``partials`` (and no
    bias) returns the partials for the consumer to add (``kiln.kernels.partials``).
    A program takes up to ``nt`` token tiles of eight (``wq_config.mma_token_tiles``);
    more rows run in blocks of 8 ``nt``, on the grid's first axis beside their weights.
    ``zs``: the zero point subtracted from the codes instead of the sum(x) ``mma``;
    ``wcm``: the words' cache modifier ("" or ".cg"). ``scale`` and ``zero`` may be (N,
    groups) or its transpose's view, with the same strides."""
    from kiln.kernels.gemv import split_k_reduce

    m, k = x.shape
    n = w.numel() * w.element_size() // (k // 2)  # (N, K/2) bytes, or tile_words' order
    group = k // scale.shape[1]
    if zero.stride() != scale.stride():
        raise ValueError(f"zero strides {zero.stride()} differ from scale's {scale.stride()}")
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
        out, part, m, n, k, x.stride(0) // 2, k // 8 if tiled else w.stride(0) // 4,
        scale.stride(0), scale.stride(1),
        out.stride(0), k_per_split, 0x43004300, blocks, R=r, SPLIT_K=split, GROUP=group,
        NW=num_warps, CH=ch, PF=pf, NT=nt, HAS_BIAS=bias is not None, num_warps=num_warps,
        **({"ZS": True} if zs else {}), **({"WCM": wcm} if wcm else {}),
        **({"ST": st} if st else {}), **({"TL": True} if tiled else {}),
        **pdl.dependent_kwargs(x),
    )  # fmt: skip
    if split > 1:
        if partials and bias is None:
            return SplitPartials(part, x.dtype)
        split_k_reduce(part, out, bias)
    return out


def tile_words(p: torch.Tensor) -> torch.Tensor:
    """(N, K/2) packed bytes -> the same words as (N/16, K/128, 16, 16) int32: row tile,
    chunk, row in the tile, word in the chunk (``TL``)."""
    w = p.view(torch.int32)
    n, kw = w.shape
    return w.view(n // 16, 16, kw // 16, 16).permute(0, 2, 1, 3).contiguous()
