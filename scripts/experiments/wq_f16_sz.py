"""The float16-code int4 kernel (``kiln.kernels.wq_f16``, as at 71558d3) with its group
scales and zeros read three ways (``SZ``), for ``f16_sz.py``:

- 0: as the engine reads them: four loads a chunk and row group (the float16 scales and
  uint8 zeros of rows g and g + 8, each a row-major (N, K / G) tensor);
- 1: not read (constants): the bound on what reading them costs;
- 2: packed by row pairs: rows 16 T + i and 16 T + i + 8 (i < 8) of a 16-row tile share an
  int32 of their two float16 scales and an int16 of their two zeros ((N / 2, K / G) each,
  ``pack_sz``), so two loads a chunk and row group in place of four, the same bytes.

Everything else is the engine's kernel; ``f16_sz.py`` checks 2 against 0 bit for bit. On an
H100 (results/2026-12-06-h100-f16-pf2-pack.json) 2 was mostly slower than 0, and the same
packing in the engine (615298e, reverted) cost 0.05 ms a batch-1 step."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.kernels.wq_f16 import MAGIC, F16Act
from kiln.kernels.wq_f16_ops import _chunk16, _eight, _ldw, _ldw4
from kiln.kernels.wq_gluon import _gdc
from kiln.kernels.wq_mma import _store, _words_layout


def pack_sz(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, G) float16 scales and uint8 zeros -> (N / 2, G) int32 and int16: row 8 T + i
    holds rows 16 T + i (low half) and 16 T + i + 8 (high half)."""
    n, g = scale.shape
    s = scale.contiguous().view(torch.int16).to(torch.int32).view(n // 16, 2, 8, g)
    z = zero.to(torch.int32).view(n // 16, 2, 8, g)
    s2 = (s[:, 0] & 0xFFFF) | (s[:, 1] << 16)
    z2 = z[:, 0] | (z[:, 1] << 8)
    return s2.reshape(n // 2, g).contiguous(), z2.to(torch.int16).reshape(n // 2, g).contiguous()


@gluon.jit
def _scales(sa_p, sb_p, za_p, zb_p, gi, SZ: gl.constexpr):
    if SZ == 0:
        sa = gl.load(sa_p + gi).to(gl.float32)
        sb = gl.load(sb_p + gi).to(gl.float32)
        za = gl.load(za_p + gi).to(gl.float32)
        zb = gl.load(zb_p + gi).to(gl.float32)
    elif SZ == 1:
        one = (gi * 0).to(gl.float32)  # broadcasts as the loads' values would
        sa = one + 0.01
        sb = one + 0.02
        za = one + 7.0
        zb = one + 8.0
    else:
        s2 = gl.load(sa_p + gi)
        z2 = gl.load(za_p + gi).to(gl.int32)
        sa = (s2 & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        sb = ((s2 >> 16) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        za = (z2 & 0xFF).to(gl.float32)
        zb = ((z2 >> 8) & 0xFF).to(gl.float32)
    return sa, sb, za, zb


@gluon.jit
def _acc16(t, wa, wb, kx, kwx, kws, ks, k_hi, xp, sp, sa_p, sb_p, za_p, zb_p, magic,
           GROUP: gl.constexpr, S: gl.constexpr, L: gl.constexpr, M1: gl.constexpr,
           EVEN: gl.constexpr, SZ: gl.constexpr):  # fmt: skip
    if EVEN:
        gi = ks // GROUP
        u = gl.load(xp + gl.multiple_of(kx // 2, 16))
        sm = gl.load(sp + gl.multiple_of(kx // 4, 16))
    else:
        gi = gl.minimum(ks, k_hi - 1) // GROUP
        u = gl.load(xp + gl.multiple_of(kx // 2, 16), mask=kx + kwx < k_hi, other=0)
        sm = gl.load(sp + gl.multiple_of(kx // 4, 16), mask=kx + kws < k_hi, other=0.0)
    sa, sb, za, zb = _scales(sa_p, sb_p, za_p, zb_p, gi, SZ)
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
            L: gl.constexpr, M1: gl.constexpr, EVEN: gl.constexpr, SZ: gl.constexpr):  # fmt: skip
    t = _acc16(t, a0, b0, k0, kwx, kws, k0 + kw, k_hi, xp, sp, sa_p, sb_p, za_p, zb_p, magic,
               GROUP, S, L, M1, EVEN, SZ)  # fmt: skip
    if CH == 2:
        k1 = k0 + 128 * NW
        t = _acc16(t, a1, b1, k1, kwx, kws, k1 + kw, k_hi, xp, sp, sa_p, sb_p, za_p, zb_p,
                   magic, GROUP, S, L, M1, EVEN, SZ)  # fmt: skip
    return t


@gluon.jit
def _kernel(x_ptr, sum_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, M, N, K, stride_xm,
            stride_sn, stride_om, k_per_split, magic, R: gl.constexpr, SPLIT_K: gl.constexpr,
            GROUP: gl.constexpr, NW: gl.constexpr, CH: gl.constexpr, PF: gl.constexpr,
            PDL: gl.constexpr, M1: gl.constexpr, EVEN: gl.constexpr, EVEN2: gl.constexpr,
            SZ: gl.constexpr):  # fmt: skip
    P: gl.constexpr = _words_layout(R, NW)
    S: gl.constexpr = gl.SliceLayout(3, P)
    L: gl.constexpr = gl.SliceLayout(1, S)
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    SL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    if PDL:
        _gdc(False)
    tile = gl.program_id(0)
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(0, S)))
    g = lane // 4
    t = lane % 4
    grp = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(0, S)))
    row = gl.expand_dims(tile * (16 * R) + gl.expand_dims(grp, 1) * 16 + gl.expand_dims(g, 0), 0)
    ra = gl.minimum(row, N - 1)
    rb = gl.minimum(row + 8, N - 1)
    wid = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, S)))
    kw = gl.expand_dims(gl.expand_dims(wid * 128, 1), 2)
    w4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, P))))
    w4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(w4, 0), 1), 2)
    t4 = gl.expand_dims(gl.expand_dims(t * 4, 0), 0)
    kw4 = gl.expand_dims(kw, 3)
    per_tile = (K // 128) * 256
    ba = (ra // 16).to(gl.int64) * per_tile + (ra % 16) * 16
    bb = (rb // 16).to(gl.int64) * per_tile + (rb % 16) * 16
    wpa = w_ptr + gl.expand_dims(ba + t4, 3) + (w4 + kw4 * 2)
    wpb = w_ptr + gl.expand_dims(bb + t4, 3) + (w4 + kw4 * 2)
    xl = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
    xg = gl.expand_dims(gl.expand_dims(gl.minimum(xl // 4, M - 1), 0), 2)
    x16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
    xp = (x_ptr + xg * stride_xm + gl.expand_dims(gl.expand_dims((xl % 4) * 16, 0), 2)
          + gl.expand_dims(gl.expand_dims(x16, 0), 1))  # fmt: skip
    kwx = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))) * 128
    xp = xp + gl.expand_dims(gl.expand_dims(kwx, 1), 2) // 2
    sl = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
    s8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
    kws = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL))) * 128
    sp = (sum_ptr + gl.expand_dims(gl.expand_dims(kws // 4, 1), 2)
          + gl.expand_dims(gl.expand_dims((sl % 4) * 8, 0), 2)
          + gl.expand_dims(gl.expand_dims(s8, 0), 1))  # fmt: skip
    kwx3 = gl.expand_dims(gl.expand_dims(kwx, 1), 2)
    kws3 = gl.expand_dims(gl.expand_dims(kws, 1), 2)
    k_lo = gl.program_id(1) * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    if SZ == 2:  # the pair's packed row: tile T's row i < 8 (N is whole tiles)
        pr = gl.minimum(row // 16, N // 16 - 1) * 8 + row % 16
        sa_p = s_ptr + pr * stride_sn
        za_p = z_ptr + pr * stride_sn
        sb_p = sa_p
        zb_p = za_p
    else:
        sa_p = s_ptr + ra * stride_sn
        sb_p = s_ptr + rb * stride_sn
        za_p = z_ptr + ra * stride_sn
        zb_p = z_ptr + rb * stride_sn
    z0 = gl.zeros([NW, R, 32], gl.float32, S)
    acc = (z0, z0, z0, z0)
    STEP: gl.constexpr = 128 * NW * CH
    if PF == 2:
        na0, nb0, na1, nb1 = _ldw4(wpa, wpb, k_lo, kw4, k_lo, k_hi, NW, CH)
        if PDL:
            _gdc(True)
        for k0 in range(k_lo, k_hi, 2 * STEP):
            k2 = k0 + STEP
            pa0, pb0, pa1, pb1 = _ldw4(wpa, wpb, k2, kw4, k_lo, k_hi, NW, CH)
            acc = _iter16(acc, na0, nb0, na1, nb1, k0, kw, kwx3, kws3, k_hi, xp, sp, sa_p,
                          sb_p, za_p, zb_p, magic, GROUP, NW, CH, S, L, M1, EVEN, SZ)  # fmt: skip
            na0, nb0, na1, nb1 = _ldw4(wpa, wpb, k2 + STEP, kw4, k_lo, k_hi, NW, CH)
            acc = _iter16(acc, pa0, pb0, pa1, pb1, k2, kw, kwx3, kws3, k_hi, xp, sp, sa_p,
                          sb_p, za_p, zb_p, magic, GROUP, NW, CH, S, L, M1, EVEN2, SZ)  # fmt: skip
    else:
        for k0 in range(k_lo, k_hi, STEP):
            a0 = _ldw(wpa, k0, kw4, k_hi, EVEN)
            b0 = _ldw(wpb, k0, kw4, k_hi, EVEN)
            a1, b1 = a0, b0
            if CH == 2:
                a1 = _ldw(wpa, k0 + 128 * NW, kw4, k_hi, EVEN)
                b1 = _ldw(wpb, k0 + 128 * NW, kw4, k_hi, EVEN)
            if PDL:  # noqa: SIM102
                if k0 == k_lo:
                    _gdc(True)
            acc = _iter16(acc, a0, b0, a1, b1, k0, kw, kwx3, kws3, k_hi, xp, sp, sa_p, sb_p,
                          za_p, zb_p, magic, GROUP, NW, CH, S, L, M1, EVEN, SZ)  # fmt: skip
    tok = gl.expand_dims(2 * t, 0)
    rw = gl.convert_layout(gl.reshape(row, [R, 32]), gl.SliceLayout(0, S))
    _store(gl.sum(acc[0], axis=0), rw, tok, out_ptr, out_ptr, part_ptr, M, N, stride_om,
           SPLIT_K, False)  # fmt: skip
    _store(gl.sum(acc[2], axis=0), rw + 8, tok, out_ptr, out_ptr, part_ptr, M, N, stride_om,
           SPLIT_K, False)  # fmt: skip


def run(a: F16Act, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, cfg: dict, sz: int,
        finish: bool = True, group: int = 128) -> torch.Tensor:  # fmt: skip
    """One row (M 1) through the variant (``PF`` 0 or 2): ``s`` / ``z`` as ``SZ`` reads them
    (``pack_sz``'s for 2). Split-K partials summed by torch when ``finish``, else returned
    as they are (for timing the kernel alone)."""
    m, k = a.shape
    n = w.shape[0]
    assert m == 1 and int(cfg["PF"]) in (0, 2), (m, cfg)
    split = cfg["SPLIT_K"]
    k_per_split = triton.cdiv(k // 128, split) * 128
    split = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=a.dtype, device=w.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=w.device) if split > 1 else out
    nw, ch = cfg["num_warps"], cfg["CH"]
    even = k_per_split % (128 * nw * ch) == 0 and k % k_per_split == 0
    even2 = even and k_per_split % (256 * nw * ch) == 0
    _kernel[(triton.cdiv(n, 16 * cfg["R"]), split)](
        a.xq, a.sums, w.view(torch.int32), s, z, out, part, m, n, k, a.xq.stride(0),
        s.stride(0), out.stride(0), k_per_split, MAGIC, R=cfg["R"], SPLIT_K=split,
        GROUP=group, NW=nw, CH=ch, PF=int(cfg["PF"]), PDL=False, M1=True, EVEN=even,
        EVEN2=even2, SZ=sz, num_warps=nw,
    )  # fmt: skip
    if split == 1 or not finish:
        return out if split == 1 else part
    return part.sum(0).to(a.dtype)
