"""The float16-code int4 kernel's per-chunk pieces (``kiln.kernels.wq_f16``): the ``mma``,
unpacking a word of codes into float16 ``1024 + q`` pairs, one 128-code chunk's products,
the word loads, and an iteration's chunks scaled by the guard's multiplier and the group's
scale and zero."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.kernels.wq_mma_ops import _halves, _words

_MMA16 = gl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)


@gluon.jit
def _mma16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return gl.inline_asm_elementwise(
        _MMA16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _eight(v, L: gl.constexpr):
    """(NW, 32, 8) -> its eight elements in order, each (NW, 32) in ``L``."""
    p, q = _halves(v)  # p: 0 2 4 6, q: 1 3 5 7
    p0, p1 = _halves(p)  # 0 4, 2 6
    q0, q1 = _halves(q)  # 1 5, 3 7
    v0, v4 = gl.split(p0)
    v2, v6 = gl.split(p1)
    v1, v5 = gl.split(q0)
    v3, v7 = gl.split(q1)
    return (gl.convert_layout(v0, L), gl.convert_layout(v1, L), gl.convert_layout(v2, L),
            gl.convert_layout(v3, L), gl.convert_layout(v4, L), gl.convert_layout(v5, L),
            gl.convert_layout(v6, L), gl.convert_layout(v7, L))  # fmt: skip


@gluon.jit
def _unpack(w, magic):
    """A word's two halves' ``1024 + q`` (nibbles 2h, 2h + 4) and ``1024 + 16 q`` (2h + 1,
    2h + 5) float16 pairs: (lo0, hi0, lo1, hi1)."""
    w8 = w >> 8  # the sign bits it shifts in are masked off
    return ((w & 0x000F000F) | magic, (w & 0x00F000F0) | magic,
            (w8 & 0x000F000F) | magic, (w8 & 0x00F000F0) | magic)  # fmt: skip


@gluon.jit
def _word(c, wa, wb, b00, b10, b01, b11, magic):
    """Both mma steps of one word of rows g (wa) and g + 8 (wb)."""
    al0, ah0, al1, ah1 = _unpack(wa, magic)
    bl0, bh0, bl1, bh1 = _unpack(wb, magic)
    c0, c1, c2, c3 = _mma16(al0, bl0, ah0, bh0, gl.expand_dims(b00, 1), gl.expand_dims(b10, 1),
                            c[0], c[1], c[2], c[3])  # fmt: skip
    c0, c1, c2, c3 = _mma16(al1, bl1, ah1, bh1, gl.expand_dims(b01, 1), gl.expand_dims(b11, 1),
                            c0, c1, c2, c3)  # fmt: skip
    return (c0, c1, c2, c3)


@gluon.jit
def _chunk16(wa, wb, u, magic, S: gl.constexpr, L: gl.constexpr):
    """One 128-code chunk a warp: float32 sums of the codes' float16 values times x's
    prepared values, rows g / g + 8 by tokens 2t / 2t + 1 (c0..c3, (NW, R, 32))."""
    g0, g1, g2, g3 = _words(wa, S)
    h0, h1, h2, h3 = _words(wb, S)
    e, o = _halves(u)  # b0 and b1 of steps 0..7
    e0, e1, e2, e3, e4, e5, e6, e7 = _eight(e, L)
    o0, o1, o2, o3, o4, o5, o6, o7 = _eight(o, L)
    z = gl.zeros(g0.shape, gl.float32, S)
    c = (z, z, z, z)
    c = _word(c, g0, h0, e0, o0, e1, o1, magic)
    c = _word(c, g1, h1, e2, o2, e3, o3, magic)
    c = _word(c, g2, h2, e4, o4, e5, o5, magic)
    c = _word(c, g3, h3, e6, o6, e7, o7, magic)
    return c


@gluon.jit
def _ldw(wp, k0, kw4, k_hi, EVEN: gl.constexpr):
    """The (NW, R, 32, 4) tile-major words of each warp's chunk at code k0 + kw4 (a chunk's
    words 256 further); zeros past ``k_hi`` unless every split is whole iterations."""
    off = gl.multiple_of(k0 * 2, 16)
    if EVEN:
        return gl.load(wp + off, eviction_policy="evict_first")
    return gl.load(wp + off, mask=k0 + kw4 < k_hi, other=0, eviction_policy="evict_first")


@gluon.jit
def _ldw_next(wp, k0, kw4, k_lo, k_hi):
    """``_ldw``'s words for ``PF`` 2's prefetch: unmasked, a warp's chunk past ``k_hi``
    read from ``k_lo`` instead (in bounds; such words meet x's zeros)."""
    kk = gl.where(k0 + kw4 < k_hi, k0 + kw4, k_lo)
    return gl.load(wp + (kk - kw4) * 2, eviction_policy="evict_first")


@gluon.jit
def _ldw_iter(wpa, wpb, k0, kw4, k_lo, k_hi, EVEN: gl.constexpr, NEXT: gl.constexpr,
              NW: gl.constexpr, CH: gl.constexpr):  # fmt: skip
    """An iteration's words: rows g and g + 8 of each warp's chunk at k0, then of its chunk
    128 NW codes on (with CH 1, the first again); by ``_ldw``, or with ``NEXT`` by
    ``_ldw_next`` (``PF`` 2's prefetch)."""
    if NEXT:
        a0 = _ldw_next(wpa, k0, kw4, k_lo, k_hi)
        b0 = _ldw_next(wpb, k0, kw4, k_lo, k_hi)
    else:
        a0 = _ldw(wpa, k0, kw4, k_hi, EVEN)
        b0 = _ldw(wpb, k0, kw4, k_hi, EVEN)
    a1, b1 = a0, b0
    if CH == 2:
        if NEXT:
            a1 = _ldw_next(wpa, k0 + 128 * NW, kw4, k_lo, k_hi)
            b1 = _ldw_next(wpb, k0 + 128 * NW, kw4, k_lo, k_hi)
        else:
            a1 = _ldw(wpa, k0 + 128 * NW, kw4, k_hi, EVEN)
            b1 = _ldw(wpb, k0 + 128 * NW, kw4, k_hi, EVEN)
    return a0, b0, a1, b1


@gluon.jit
def _acc16(t, wa, wb, kx, kwx, kws, ks, k_hi, xp, sp, sa_p, sb_p, za_p, zb_p, magic,
           GROUP: gl.constexpr, S: gl.constexpr, L: gl.constexpr, M1: gl.constexpr,
           EVEN: gl.constexpr):  # fmt: skip
    """``t`` plus each warp's chunk at code kx + kwx, scaled per chunk (the guard's
    multiplier) and group. x's rows past M read row M - 1 (``xp`` clamped), whose sums
    land in columns never stored."""
    if EVEN:
        gi = ks // GROUP
        u = gl.load(xp + gl.multiple_of(kx // 2, 16))
        sm = gl.load(sp + gl.multiple_of(kx // 4, 16))
    else:
        gi = gl.minimum(ks, k_hi - 1) // GROUP
        u = gl.load(xp + gl.multiple_of(kx // 2, 16), mask=kx + kwx < k_hi, other=0)
        sm = gl.load(sp + gl.multiple_of(kx // 4, 16), mask=kx + kws < k_hi, other=0.0)
    sa = gl.load(sa_p + gi).to(gl.float32)  # float32 or float16 scales
    sb = gl.load(sb_p + gi).to(gl.float32)
    za = gl.load(za_p + gi).to(gl.float32)
    zb = gl.load(zb_p + gi).to(gl.float32)
    se0, so0, m0, _p0, se1, so1, m1, _p1 = _eight(sm, L)
    c0, c1, c2, c3 = _chunk16(wa, wb, u, magic, S, L)
    se0 = gl.expand_dims(se0, 1)
    so0 = gl.expand_dims(so0, 1)
    m0 = gl.expand_dims(m0, 1)
    ka = 1024.0 + za
    kb = 1024.0 + zb
    t0 = t[0] + (sa * m0) * (c0 - ka * se0 - (ka + 15.0 * za) * so0)
    t2 = t[2] + (sb * m0) * (c2 - kb * se0 - (kb + 15.0 * zb) * so0)
    if M1:
        return (t0, t[1], t2, t[3])
    se1 = gl.expand_dims(se1, 1)
    so1 = gl.expand_dims(so1, 1)
    m1 = gl.expand_dims(m1, 1)
    t1 = t[1] + (sa * m1) * (c1 - ka * se1 - (ka + 15.0 * za) * so1)
    t3 = t[3] + (sb * m1) * (c3 - kb * se1 - (kb + 15.0 * zb) * so1)
    return (t0, t1, t2, t3)


@gluon.jit
def _iter16(t, a0, b0, a1, b1, k0, kw, kwx, kws, k_hi, xp, sp, sa_p, sb_p, za_p, zb_p, magic,
            GROUP: gl.constexpr, NW: gl.constexpr, CH: gl.constexpr, S: gl.constexpr,
            L: gl.constexpr, M1: gl.constexpr, EVEN: gl.constexpr):  # fmt: skip
    """One iteration: ``t`` plus each warp's CH chunks at code k0 (words a0 / b0, then
    a1 / b1 128 NW codes on)."""
    t = _acc16(t, a0, b0, k0, kwx, kws, k0 + kw, k_hi, xp, sp, sa_p, sb_p, za_p, zb_p, magic,
               GROUP, S, L, M1, EVEN)  # fmt: skip
    if CH == 2:
        k1 = k0 + 128 * NW
        t = _acc16(t, a1, b1, k1, kwx, kws, k1 + kw, k_hi, xp, sp, sa_p, sb_p, za_p, zb_p,
                   magic, GROUP, S, L, M1, EVEN)  # fmt: skip
    return t
