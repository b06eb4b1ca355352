"""Few-row int4 weight-only matmul on the tensor cores with float16 codes (Gluon, ``mma.sync``
m16n8k16 f16), for x prepared by its producer (``kiln.kernels.f16_prep``) and weights
stored tile-major (``tile_words``).

Why: the bfloat16-code kernel (``kiln.kernels.wq_mma``) spends seven integer instructions a
word of codes and a ``prmt`` per x pair; on the H200 the one-row projections are bound by
those instructions' issue as much as by memory (2026-12-05 ncu: issue slots 25-53 % busy
at the occupancy the registers allow). Here a word takes five: ``lop3(w, 0x000F000F,
0x6400)`` gives the float16 ``1024 + q`` of nibbles 0 and 4, ``lop3(w, 0x00F000F0,
0x6400)`` ``1024 + 16 q`` of nibbles 1 and 5, and one shift by 8 and two more ``lop3`` the
other four. x meets them as prepared: float16, odd values divided by 16, each word's eight
values in the order the ``mma`` fragments take them (no ``prmt``), and per 128-code chunk
and token the sums of its even and odd values and a power-of-two multiplier (the range
guard). The zero point and the codes' 1024 come off per chunk,
``mult * (acc - (1024 + zero) * S_even - (1024 + 16 zero) * S_odd)``, then the group's
scale; no sum(x) ``mma``. On tile-major words (per 16-row tile and 128-code chunk, the 16
rows' 16 words, 1 KB contiguous) the four projections of 32 layers ran 1.300-1.310 ms on
the H200 against 1.527-1.531 on row-major ones and the engine's 1.456-1.466
(``scripts/experiments/int4_mma_f16.py``, 2026-12-05).

Fragments as in ``wq_mma`` (lane l = 4 g + t: rows g and g + 8, tokens 2t and 2t + 1).
Gluon does not run in Triton's interpreter: on the CPU ``wq4_f16_ref`` computes the same
product, and CI compiles the kernel for sm_90 (``tests/test_wq_f16.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.errors import env_flag
from kiln.kernels import pdl
from kiln.kernels.partials import SplitPartials
from kiln.kernels.wq_f16_ops import _iter16, _ldw_iter
from kiln.kernels.wq_gluon import _gdc
from kiln.kernels.wq_mma import _store, _words_layout

ENABLED = env_flag(os.environ, "KILN_WQ_F16", True)
"""Whether builds time this kernel and loads tile the projections it wins on (on by
default; ``KILN_WQ_F16=0`` at build or at load turns it off). On an H100 (2026-12-06,
one engine) batch-1 TPOT was 2.03 ms with it against 2.08 without; its first engine,
whose RMSNorm producer ran one program a row, had lost (2.14 against 2.09)."""
HEAD = env_flag(os.environ, "KILN_WQ_F16_HEAD", True)
"""Whether loads give a quantized head the kernel too where it won (``KILN_WQ_F16_HEAD=0``
at load: not; for an A/B on one engine)."""
CHUNK = 128
MAX_M = 8  # tokens: one token tile (the n dimension of an mma)
TILE = 16  # weight rows of a tile-major tile
MAGIC = 0x64006400  # float16 1024 in both halves
SZPF = env_flag(os.environ, "KILN_WQ_F16_SZPF", True)
"""Whether, under programmatic dependent launch, a program asks L2 for its rows' scales and
zeros (their first and last groups of the split) before ``griddepcontrol.wait`` (``SZPF``
of ``_wq4_f16_kernel``; ``KILN_WQ_F16_SZPF=0`` at load: not). They are no kernel's output,
and without it the first iteration loaded them after the wait; the rows kernel loads its
first tile's scales and zeros before its wait (``kiln.kernels.wq_gluon._rows_sum``). On an
H100 (2026-12-06) no gain was measured: with the words streamed ``evict_first`` the scales
likely stay in L2 between steps."""


@dataclass
class F16Act:
    """x prepared for this kernel by its producer (``kiln.kernels.f16_prep``): ``xq`` (M,
    K / 2) int32 of float16 pairs, ``sums`` (K / 128, 8, 4) float32, and the dtype the
    consumer's output takes (the model's)."""

    xq: torch.Tensor
    sums: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.xq.shape[0], 2 * self.xq.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.xq.device


# ------------------------------------------------------------------ the layout


def tile_words(w: torch.Tensor) -> torch.Tensor:
    """(N, K / 2) packed int4 codes (``kiln.quant.formats``; N a multiple of 16, K of 128)
    -> the same bytes tile-major: per 16-row tile, per 128-code chunk, its 16 rows' 16
    words, as (N, K / 2) uint8."""
    n, kb = w.shape
    if n % TILE or kb % (CHUNK // 2):
        raise ValueError(f"int4 weight of shape {(n, kb)}: N must be a multiple of 16, K of 128")
    t = w.contiguous().view(torch.int32).view(n // TILE, TILE, kb // 64, 16)
    return t.permute(0, 2, 1, 3).contiguous().view(torch.uint8).view(n, kb)


def untile_words(w: torch.Tensor) -> torch.Tensor:
    """``tile_words``' inverse: row-major packed codes."""
    n, kb = w.shape
    t = w.contiguous().view(torch.int32).view(n // TILE, kb // 64, TILE, 16)
    return t.permute(0, 2, 1, 3).contiguous().view(torch.uint8).view(n, kb)


def f16_eligible(n: int, k: int, group: int | None) -> bool:
    """Whether an int4 projection's shape takes this kernel: N of whole 16-row tiles, K and
    the group of whole 128-code chunks."""
    return group is not None and n % TILE == 0 and k % CHUNK == 0 and group % CHUNK == 0


def f16_config(r: int, warps: int, split: int, ch: int = 2, pf: bool | int = False) -> dict:
    """A configuration of this kernel: R groups of 16 rows a program, its warps on
    alternate chunks, CH chunks a warp an iteration, PF the prefetch (False / 0 none, True
    / 1 the register double buffer, 2 two iterations a trip; ``_wq4_f16_kernel``), and
    ``BLOCK_N`` and ``BLOCK_K`` for the split-K plan the tuner reads."""
    return {"F16": True, "R": r, "BLOCK_N": 16 * r, "BLOCK_K": CHUNK, "SPLIT_K": split,
            "CH": ch, "PF": pf, "num_warps": warps}  # fmt: skip


DEFAULT = f16_config(1, 4, 4, 1)
"""Untuned: the H200's one-row pick for down (R 1, 4 warps, split 4, one chunk a step)."""


# ------------------------------------------------------------------ the kernel


@gluon.jit
def _wq4_f16_kernel(x_ptr, sum_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, M, N, K,
                    stride_xm, stride_sn, stride_om, k_per_split, magic, R: gl.constexpr,
                    SPLIT_K: gl.constexpr, GROUP: gl.constexpr, NW: gl.constexpr,
                    CH: gl.constexpr, PF: gl.constexpr, PDL: gl.constexpr,
                    M1: gl.constexpr, EVEN: gl.constexpr, EVEN2: gl.constexpr,
                    ROUND: gl.constexpr = 0, SZPF: gl.constexpr = False):  # fmt: skip
    """Grid (N / (16 R), SPLIT_K), up to eight tokens: ``wq_mma._wq4_mma_kernel``'s tiles
    and loop (NW warps on alternate chunks, CH chunks an iteration) with float16 codes, x
    as ``f16_prep`` writes it and the words tile-major. ``PF`` 1: the next iteration's
    words loaded first (ptxas sinks those loads to the loop's end and copies them, see
    ``scripts/experiments/sass_loop.py``); 2: two iterations a trip, each one's words
    loaded before the other's arithmetic (no copies). ``M1``: one token (the lanes'
    second token column not scaled). ``EVEN``: every split is whole iterations (no
    masks); ``EVEN2``: whole trips of two. ``PDL``: the first words load before
    ``griddepcontrol.wait`` (they are no kernel's output); with ``SZPF`` the lines of the
    rows' scales and zeros are asked of L2 there too (``_sz_prefetch``)."""
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
    per_tile = (K // 128) * 256  # words of a 16-row tile
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
    # a chunk's sums: 8 tokens x [even, odd, multiplier, 0]; lane t: tokens 2t and 2t + 1
    sp = (sum_ptr + gl.expand_dims(gl.expand_dims(kws // 4, 1), 2)
          + gl.expand_dims(gl.expand_dims((sl % 4) * 8, 0), 2)
          + gl.expand_dims(gl.expand_dims(s8, 0), 1))  # fmt: skip
    kwx3 = gl.expand_dims(gl.expand_dims(kwx, 1), 2)
    kws3 = gl.expand_dims(gl.expand_dims(kws, 1), 2)
    k_lo = gl.program_id(1) * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    sa_p = s_ptr + ra * stride_sn
    sb_p = s_ptr + rb * stride_sn
    za_p = z_ptr + ra * stride_sn
    zb_p = z_ptr + rb * stride_sn
    if PDL and SZPF:  # before the wait: L2 asked for the scales' and zeros' lines
        _sz_prefetch(sa_p, sb_p, za_p, zb_p, ra, t, k_lo // GROUP, (k_hi - 1) // GROUP)
    z0 = gl.zeros([NW, R, 32], gl.float32, S)
    acc = (z0, z0, z0, z0)
    STEP: gl.constexpr = 128 * NW * CH
    gl.static_assert(CH == 1 or CH == 2, "CH: 1 or 2")
    if PF == 2:  # two iterations a trip, each one's words loaded during the other's math
        na0, nb0, na1, nb1 = _ldw_iter(wpa, wpb, k_lo, kw4, k_lo, k_hi, EVEN, True, NW, CH)
        if PDL:
            _gdc(True)
        for k0 in range(k_lo, k_hi, 2 * STEP):
            k2 = k0 + STEP
            pa0, pb0, pa1, pb1 = _ldw_iter(wpa, wpb, k2, kw4, k_lo, k_hi, EVEN, True, NW, CH)
            acc = _iter16(acc, na0, nb0, na1, nb1, k0, kw, kwx3, kws3, k_hi, xp, sp, sa_p,
                          sb_p, za_p, zb_p, magic, GROUP, NW, CH, S, L, M1, EVEN)  # fmt: skip
            na0, nb0, na1, nb1 = _ldw_iter(wpa, wpb, k2 + STEP, kw4, k_lo, k_hi, EVEN, True, NW, CH)
            # past k_hi (an odd count of iterations) x and its sums load as zeros: adds 0
            acc = _iter16(acc, pa0, pb0, pa1, pb1, k2, kw, kwx3, kws3, k_hi, xp, sp, sa_p,
                          sb_p, za_p, zb_p, magic, GROUP, NW, CH, S, L, M1, EVEN2)  # fmt: skip
    else:
        if PF:  # the next iteration's loads stay masked: the last one's reach past k_hi
            na0, nb0, na1, nb1 = _ldw_iter(wpa, wpb, k_lo, kw4, k_lo, k_hi, False, False, NW, CH)
            if PDL:
                _gdc(True)
        for k0 in range(k_lo, k_hi, STEP):
            if PF:
                a0, b0, a1, b1 = na0, nb0, na1, nb1
                na0, nb0, na1, nb1 = _ldw_iter(wpa, wpb, k0 + STEP, kw4, k_lo, k_hi, False,
                                               False, NW, CH)  # fmt: skip
            else:
                a0, b0, a1, b1 = _ldw_iter(wpa, wpb, k0, kw4, k_lo, k_hi, EVEN, False, NW, CH)
                if PDL:  # noqa: SIM102
                    if k0 == k_lo:
                        _gdc(True)
            acc = _iter16(acc, a0, b0, a1, b1, k0, kw, kwx3, kws3, k_hi, xp, sp, sa_p, sb_p,
                          za_p, zb_p, magic, GROUP, NW, CH, S, L, M1, EVEN)  # fmt: skip
    tok = gl.expand_dims(2 * t, 0)
    rw = gl.convert_layout(gl.reshape(row, [R, 32]), gl.SliceLayout(0, S))
    _store(_round(gl.sum(acc[0], axis=0), ROUND), rw, tok, out_ptr, out_ptr, part_ptr, M, N,
           stride_om, SPLIT_K, False)  # fmt: skip
    _store(_round(gl.sum(acc[2], axis=0), ROUND), rw + 8, tok, out_ptr, out_ptr, part_ptr, M,
           N, stride_om, SPLIT_K, False)  # fmt: skip
    if not M1:
        _store(_round(gl.sum(acc[1], axis=0), ROUND), rw, tok + 1, out_ptr, out_ptr, part_ptr,
               M, N, stride_om, SPLIT_K, False)  # fmt: skip
        _store(_round(gl.sum(acc[3], axis=0), ROUND), rw + 8, tok + 1, out_ptr, out_ptr,
               part_ptr, M, N, stride_om, SPLIT_K, False)  # fmt: skip


@gluon.jit
def _l2_prefetch(ptr, ok):
    """``prefetch.global.L2`` of each address in ``ptr`` where ``ok`` (int32) is nonzero: the
    line starts on its way into L2 without a register or a wait."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; } // $0",
        "=r,l,r", [ptr.to(gl.int64, bitcast=True), ok], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _sz_prefetch(sa_p, sb_p, za_p, zb_p, ra, t, g_first, g_last):
    """L2 prefetches of the scales and zeros of rows g and g + 8 at a split's first group
    (lanes t = 0) and last (t = 1): a row's groups are contiguous, so for the splits of the
    tuned picks (up to 64 groups of float16 scales) these lines hold all of them."""
    tt = gl.expand_dims(gl.expand_dims(t, 0), 0) + ra * 0  # ra's shape: (1, R, 32)
    gi = gl.where(tt == 0, g_first, g_last)
    ok = (tt < 2).to(gl.int32)
    _l2_prefetch(sa_p + gi, ok)
    _l2_prefetch(sb_p + gi, ok)
    _l2_prefetch(za_p + gi, ok)
    _l2_prefetch(zb_p + gi, ok)


@gluon.jit
def _round(y, ROUND: gl.constexpr):
    """Float32 ``y`` rounded to bfloat16 (``ROUND`` 1) or float16 (2) and back: a float32
    output holds the values the model's dtype would (0: as they are)."""
    if ROUND == 1:
        y = y.to(gl.bfloat16).to(gl.float32)
    elif ROUND == 2:
        y = y.to(gl.float16).to(gl.float32)
    return y


# ------------------------------------------------------------------ launcher and reference


def wq4_f16(
    a: F16Act,
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    config: dict | None = None,
    partials: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | SplitPartials:
    """(M, N) = x @ dequantized(w).T in ``a.dtype`` for x prepared as ``a`` (M <= 8), ``w``
    in ``tile_words``' order, ``scale`` float32 or float16 (N, K / G), ``zero`` uint8. Split along K
    by ``config["SPLIT_K"]`` (whole chunks); ``partials``: the float32 partials for the
    consumer to add (``kiln.kernels.partials``), else summed here. ``out``: an (M, N)
    float32 buffer (rows contiguous) the unsplit kernel writes into, its values rounded to
    ``a.dtype`` first (the head's logits without a conversion kernel); a split launch
    ignores it (the caller checks whether the result is ``out``)."""
    from kiln.kernels.gemv import split_k_reduce

    cfg = config or DEFAULT
    m, k = a.shape
    n = w.shape[0]
    if m > MAX_M or not f16_eligible(n, k, k // scale.shape[1]):
        raise ValueError(f"wq4_f16 takes at most 8 rows of whole 16-row tiles and 128-code "
                         f"chunks; got x {tuple(a.shape)}, weight {tuple(w.shape)}")  # fmt: skip
    chunks = k // CHUNK
    split = max(1, min(cfg["SPLIT_K"], chunks))
    k_per_split = triton.cdiv(chunks, split) * CHUNK
    split = triton.cdiv(k, k_per_split)
    rnd = 0
    if split == 1 and out is not None and out.dtype == torch.float32 and out.stride(1) == 1:
        rnd = {torch.bfloat16: 1, torch.float16: 2}.get(a.dtype, 0)
    else:
        out = torch.empty(m, n, dtype=a.dtype, device=w.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=w.device) if split > 1 else out
    nw, ch = cfg["num_warps"], cfg["CH"]
    even = k_per_split % (CHUNK * nw * ch) == 0 and k % k_per_split == 0
    even2 = even and k_per_split % (2 * CHUNK * nw * ch) == 0
    _wq4_f16_kernel[(triton.cdiv(n, 16 * cfg["R"]), split)](
        a.xq, a.sums, w.view(torch.int32), scale, zero, out, part, m, n, k, a.xq.stride(0),
        scale.stride(0), out.stride(0), k_per_split, MAGIC, R=cfg["R"], SPLIT_K=split,
        GROUP=k // scale.shape[1], NW=nw, CH=ch, PF=int(cfg["PF"]), M1=m == 1, EVEN=even,
        EVEN2=even2, ROUND=rnd, SZPF=SZPF, num_warps=nw, **pdl.dependent_kwargs(out),
    )  # fmt: skip
    if split == 1:
        return out
    if partials:
        return SplitPartials(part, a.dtype)
    split_k_reduce(part, out, None)
    return out


def f16_values(a: F16Act) -> torch.Tensor:
    """The real (M, K) float32 values ``a`` holds: its float16 values in natural order,
    odd ones times 16, each chunk times its multiplier."""
    from kiln.kernels.f16_prep import unprep_ref

    v = unprep_ref(a.xq, a.sums)
    v[:, 1::2] *= 16
    return v


def wq4_f16_ref(a: F16Act, w: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The kernel's product on any device: x's real values (``f16_values``) times the
    dequantized untiled weight, in float32, rounded to ``a.dtype``."""
    from kiln.quant import formats as qf

    deq = qf.dequantize_int4(qf.unpack_int4(untile_words(w)), scale, zero)
    return (f16_values(a) @ deq.float().T).to(a.dtype)
