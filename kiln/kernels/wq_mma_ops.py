"""The register-level pieces of the tensor-core int4 kernel (``kiln.kernels.wq_mma``, whose
docstring gives the fragment layout): the bf16 ``mma.sync`` m16n8k16, the ``prmt`` that
pairs x's values, the unpacking of a 128-code chunk's words into ``128 + q`` pairs and the
eight ``mma`` steps of a chunk. ``fp8_mma`` uses ``_words`` too. GPU only (Gluon); CI
compiles the kernels that use them for sm_90."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

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
def _step(c, s, wa, wb, ua, ub, h: gl.constexpr, magic, ones, za2, zb2, ZS: gl.constexpr):
    """One mma step (16 codes of each row): word half ``h`` of rows g (wa) and g + 8 (wb),
    (NW, R, 32); x's pairs ``ua`` = u[4j + h], ``ub`` = u[4j + h + 2], (NW, 32); c and s:
    the rows' and x's accumulators. ``ZS``: the rows' ``128 + zero`` pairs (za2, zb2)
    are taken off the codes here, so that c sums (q - zero) x and s is not needed."""
    b0, b1 = _prmt(ua, ub)
    if ZS:
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
           ZS: gl.constexpr = False):  # fmt: skip
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
    c, s = _step(c, s, g0, h0, u0, u2, 0, magic, ones, za2, zb2, ZS)
    c, s = _step(c, s, g0, h0, u1, u3, 1, magic, ones, za2, zb2, ZS)
    c, s = _step(c, s, g1, h1, u4, u6, 0, magic, ones, za2, zb2, ZS)
    c, s = _step(c, s, g1, h1, u5, u7, 1, magic, ones, za2, zb2, ZS)
    c, s = _step(c, s, g2, h2, u8, u10, 0, magic, ones, za2, zb2, ZS)
    c, s = _step(c, s, g2, h2, u9, u11, 1, magic, ones, za2, zb2, ZS)
    c, s = _step(c, s, g3, h3, u12, u14, 0, magic, ones, za2, zb2, ZS)
    c, s = _step(c, s, g3, h3, u13, u15, 1, magic, ones, za2, zb2, ZS)
    return c[0], c[1], c[2], c[3], s[0], s[1]
