"""Dynamic per-token activation quantization (fp8 e4m3 or int8) for the quantized GEMMs, alone
or fused into the epilogue of the op that produces the activation: RMSNorm (with its
residual add) and SiLU-and-multiply. Triton kernels, launchers and the dispatchers the
layers call; the torch references are in ``quant_act_ref`` (re-exported here).

A quantized activation is a ``QuantAct``: ``q`` (M, K) float8_e4m3fn or int8 and ``scale``
(M, 1) float32 with ``x ~ q * scale``; ``scale = amax(|row|) / qmax`` (448 or 127), or
for fp8 with a scale search (``search`` N: ``--act-scale-search``) the candidate
``amax / 448 * (1 + j / N)`` under which the row's four largest magnitudes round to e4m3
with the least squared error (``quant_act_ref.search_fp8_scale``; the kernels do the same
scalar arithmetic, so they pick as the reference does). fp8 "block" activations
(``group`` G, 128 in the engine) have one scale per token and G consecutive channels,
``scale`` (M, ceil(K / G)), stored column-major as ``torch._scaled_mm``'s 1x128 block
scales are. When the consumer has AWQ / SmoothQuant factors ``smooth``
(K,), the row is first divided by them (``x / s`` rounded to x's dtype, as
``QuantLinear`` does unfused). Every kernel reproduces its reference exactly: the same
roundings in the same order (the fused ops round their output to x's dtype before
quantizing it, as the unfused sequence does).

fp8 "outliers" activations (``outliers``: the consumer's C input channels, an increasing
int64 tensor; no smoothing): the row is quantized per token as usual (q, K columns), and
2C columns follow: the C values ``lo = e4m3(v_j - hi_j)`` of the channels j in the order
of ``outliers``, then their C values ``hi = q_j``, where
``v = x / scale`` in float32 (saturated) and ``hi_j`` its e4m3 rounding. So ``hi + lo``
holds each outlier value to about 2**-8 of itself (e4m3 twice) instead of 2**-4, and the
consumer's GEMM, with its weight's outlier columns split the same way (``[W | W_hi |
W_lo]``), adds ``lo * W_hi + hi * W_lo`` in the same fp8 product (``kiln.quant.layers``).

The kernels recompute those C values from their gathered inputs (the same roundings as the
row's), rather than picking them out of the row in registers.

One program handles one row (the whole row is needed for its amax), so rows of up to
``MAX_FUSED_K`` elements are kept in registers; longer rows fall back to the references'
op sequence on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kiln.kernels._triton import INTERPRET, use_triton
from kiln.kernels.fp8_round import (
    search_group_scales,
    search_scale,
    to_fp8,
)
from kiln.kernels.quant_act_ref import (  # noqa: F401 (re-exported: the references' home was here)
    _DTYPE,
    _QMAX,
    _TINY,
    KINDS,
    SEARCH_TOP,
    SEARCHES,
    QuantAct,
    check_search,
    quantize_rows_ref,
    rms_norm_quant_ref,
    search_fp8_scale,
    silu_and_mul_quant_ref,
)

MAX_FUSED_K = 32768
_TOP = tl.constexpr(SEARCH_TOP)

# ---------------------------------------------------------------- Triton


@triton.jit
def _store_quant(y, offs, mask, q_ptr, s_ptr, row, stride_q, stride_sg, sm_ptr, ty, yo, ci,
                 K, HAS_SMOOTH: tl.constexpr, INT8: tl.constexpr, EMULATE: tl.constexpr,
                 C: tl.constexpr, SEARCH: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Quantize one row y (float32 values of x's dtype ``ty``, K of them, 0 on the BLOCK
    lanes past K) and store q and its scale; with C outlier channels (fp8) also their lo and
    hi columns, from ``yo`` (their values of y, at lanes ``ci``); with SEARCH > 0 (fp8) the
    scale is searched (``fp8_round.search_scale``); with GROUP > 0 (fp8) one scale per GROUP
    consecutive channels, group g's at ``s_ptr + row + g * stride_sg``."""
    if HAS_SMOOTH:
        s_in = tl.load(sm_ptr + offs, mask=mask, other=1.0)
        y = tl.math.div_rn(y, s_in).to(ty).to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
    if INT8:
        scale = tl.maximum(amax, 1e-12) / 127.0
        v = tl.math.div_rn(y, scale)
        if EMULATE:  # noqa: SIM108 (constexpr branches)
            v = (v + 12582912.0) - 12582912.0  # nearest, ties to even (|v| <= 127)
        else:
            v = libdevice.rint(v)
        q = tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int8)
    elif GROUP > 0:
        NG: tl.constexpr = BLOCK // GROUP
        a2 = tl.reshape(tl.where(mask, tl.abs(y), 0.0), (NG, GROUP))
        gmax = tl.max(a2, axis=1)
        gscale = tl.maximum(gmax, 1e-12) / 448.0
        if SEARCH > 0:
            gscale = search_group_scales(a2, gmax, gscale, EMULATE, SEARCH, _TOP)
        q = tl.reshape(to_fp8(tl.reshape(y, (NG, GROUP)), gscale[:, None], EMULATE), (BLOCK,))
        gi = tl.arange(0, NG)
        tl.store(s_ptr + row + gi * stride_sg, gscale, mask=gi * GROUP < K)
    else:
        scale = tl.maximum(amax, 1e-12) / 448.0
        if SEARCH > 0:
            scale = search_scale(y, amax, scale, EMULATE, SEARCH, _TOP)
        q = to_fp8(y, scale, EMULATE)
        if C > 0:
            hi = to_fp8(yo, scale, EMULATE)
            vo = tl.minimum(tl.maximum(tl.math.div_rn(yo, scale), -448.0), 448.0)
            lo = to_fp8(vo - hi.to(tl.float32), 1.0, EMULATE)
            at = q_ptr + row * stride_q + K + ci
            tl.store(at, lo, mask=ci < C)
            tl.store(at + C, hi, mask=ci < C)
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    if GROUP == 0:
        tl.store(s_ptr + row, scale)


@triton.jit
def _outlier_lanes(idx_ptr, C: tl.constexpr, CP: tl.constexpr):
    """Lanes of the C outlier channels (CP of them: a power of two >= C, at least 16) and
    their channel indices (channel 0 on the lanes past C, whose stores are masked)."""
    ci = tl.arange(0, CP)
    return ci, tl.load(idx_ptr + ci, mask=ci < C, other=0)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, sm_ptr, idx_ptr, stride_x, stride_q, stride_sg, K,
                       HAS_SMOOTH: tl.constexpr, INT8: tl.constexpr, EMULATE: tl.constexpr,
                       C: tl.constexpr, CP: tl.constexpr, SEARCH: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    ci, io = _outlier_lanes(idx_ptr, C, CP)
    xo = ci
    if C > 0:
        xo = tl.load(x_ptr + row * stride_x + io).to(tl.float32)
    _store_quant(x.to(tl.float32), offs, mask, q_ptr, s_ptr, row, stride_q, stride_sg, sm_ptr,
                 x.dtype, xo, ci, K, HAS_SMOOTH, INT8, EMULATE, C, SEARCH, GROUP,
                 BLOCK)  # fmt: skip


@triton.jit
def _rms_norm_quant_kernel(x_ptr, r_ptr, w_ptr, r_out_ptr, q_ptr, s_ptr, sm_ptr, idx_ptr,
                           stride_x, stride_r, stride_ro, stride_q, stride_sg, hidden, eps,
                           HAS_RESIDUAL: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                           INT8: tl.constexpr, EMULATE: tl.constexpr, C: tl.constexpr,
                           CP: tl.constexpr, SEARCH: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(r_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((xf * inv).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
    ci, io = _outlier_lanes(idx_ptr, C, CP)
    yo = ci
    if C > 0:  # the outlier channels' y again, from their inputs, with the same roundings
        xo = tl.load(x_ptr + row * stride_x + io)
        if HAS_RESIDUAL:
            ro = tl.load(r_ptr + row * stride_r + io)
            xo = (xo.to(tl.float32) + ro.to(tl.float32)).to(x.dtype)
        wo = tl.load(w_ptr + io).to(tl.float32)
        yo = ((xo.to(tl.float32) * inv).to(x.dtype).to(tl.float32) * wo).to(x.dtype)
        yo = yo.to(tl.float32)
    _store_quant(y, offs, mask, q_ptr, s_ptr, row, stride_q, stride_sg, sm_ptr, x.dtype, yo,
                 ci, hidden, HAS_SMOOTH, INT8, EMULATE, C, SEARCH, GROUP, BLOCK)  # fmt: skip


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, sm_ptr, idx_ptr, stride_x, stride_q,
                           stride_sg, inter, HAS_SMOOTH: tl.constexpr, INT8: tl.constexpr,
                           EMULATE: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                           SEARCH: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    # silu rounded to x's dtype, then the product rounded: torch's F.silu(gate) * up
    y = ((gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32) * u).to(g.dtype)
    ci, io = _outlier_lanes(idx_ptr, C, CP)
    yo = ci
    if C > 0:  # the outlier channels' y again, from their inputs, with the same roundings
        go = tl.load(x_ptr + row * stride_x + io).to(tl.float32)
        uo = tl.load(x_ptr + row * stride_x + inter + io).to(tl.float32)
        yo = ((go / (1.0 + tl.exp(-go))).to(g.dtype).to(tl.float32) * uo).to(g.dtype)
        yo = yo.to(tl.float32)
    _store_quant(y.to(tl.float32), offs, mask, q_ptr, s_ptr, row, stride_q, stride_sg, sm_ptr,
                 g.dtype, yo, ci, inter, HAS_SMOOTH, INT8, EMULATE, C, SEARCH, GROUP,
                 BLOCK)  # fmt: skip


def _outputs(
    m: int,
    k: int,
    kind: str,
    device: torch.device,
    outliers: torch.Tensor | None,
    smooth: torch.Tensor | None,
    search: int,
    group: int | None,
) -> QuantAct:
    if kind not in KINDS:
        raise ValueError(f"activation quantization kind {kind!r}: expected one of {KINDS}")
    if outliers is not None and (kind != "fp8" or smooth is not None or group):
        raise ValueError("outlier channels are split for fp8 per-token quantization only")
    check_search(search, kind, group)
    if group and (kind != "fp8" or group & (group - 1) or group < 16):
        raise ValueError(f"group={group}: the kernels take fp8 groups of a power of two >= 16")
    extra = 2 * outliers.shape[0] if outliers is not None else 0
    q = torch.empty(m, k + extra, dtype=_DTYPE[kind], device=device)
    if group:  # column-major, as torch._scaled_mm takes 1x128 block scales
        scale = torch.empty(-(-k // group), m, dtype=torch.float32, device=device).t()
    else:
        scale = torch.empty(m, 1, dtype=torch.float32, device=device)
    return QuantAct(q, scale)


def _launch_opts(
    k: int,
    kind: str,
    smooth: torch.Tensor | None,
    outliers: torch.Tensor | None,
    search: int,
    group: int | None,
) -> dict:
    block = max(16, triton.next_power_of_2(k))
    c = outliers.shape[0] if outliers is not None else 0
    return dict(
        HAS_SMOOTH=smooth is not None,
        INT8=kind == "int8",
        EMULATE=INTERPRET,
        C=c,
        CP=max(16, triton.next_power_of_2(c)),
        SEARCH=search,
        # a row shorter than a group is one group (BLOCK covers it)
        GROUP=min(group, block) if group else 0,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
        # the search's sums must be rounded as the reference rounds them: no multiply-add
        # contracted into an fma (the explicit fmas stay)
        **({"enable_fp_fusion": False} if search else {}),
    )


def quantize_rows_triton(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> QuantAct:
    m, k = x.shape
    out = _outputs(m, k, kind, x.device, outliers, smooth, search, group)
    if m:
        sm = smooth if smooth is not None else out.scale
        sl = outliers if outliers is not None else out.scale
        opts = _launch_opts(k, kind, smooth, outliers, search, group)
        _quant_rows_kernel[(m,)](x, out.q, out.scale, sm, sl, x.stride(0), out.q.stride(0),
                                 out.scale.stride(1), k, **opts)  # fmt: skip
    return out


def rms_norm_quant_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> tuple[QuantAct, torch.Tensor | None]:
    t, h = x.shape
    out = _outputs(t, h, kind, x.device, outliers, smooth, search, group)
    r_out = torch.empty_like(x) if residual is not None else None
    r = residual if residual is not None else x
    ro = r_out if r_out is not None else x
    if t:
        sm = smooth if smooth is not None else weight
        sl = outliers if outliers is not None else weight
        _rms_norm_quant_kernel[(t,)](
            x, r, weight, ro, out.q, out.scale, sm, sl, x.stride(0), r.stride(0), ro.stride(0),
            out.q.stride(0), out.scale.stride(1), h, eps, HAS_RESIDUAL=residual is not None,
            **_launch_opts(h, kind, smooth, outliers, search, group),
        )  # fmt: skip
    return out, r_out


def silu_and_mul_quant_triton(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> QuantAct:
    t, two_i = x.shape
    inter = two_i // 2
    out = _outputs(t, inter, kind, x.device, outliers, smooth, search, group)
    if t:
        sm = smooth if smooth is not None else out.scale
        sl = outliers if outliers is not None else out.scale
        opts = _launch_opts(inter, kind, smooth, outliers, search, group)
        _silu_mul_quant_kernel[(t,)](x, out.q, out.scale, sm, sl, x.stride(0), out.q.stride(0),
                                     out.scale.stride(1), inter, **opts)  # fmt: skip
    return out


# ---------------------------------------------------------------- dispatchers


def _fused_ok(x: torch.Tensor, k: int) -> bool:
    return use_triton(x) and x.stride(-1) == 1 and k <= MAX_FUSED_K


def quantize_rows(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> QuantAct:
    if _fused_ok(x, x.shape[-1]):
        return quantize_rows_triton(x, kind, smooth, outliers, search, group)
    return quantize_rows_ref(x, kind, smooth, group, outliers, search)


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> tuple[QuantAct, torch.Tensor | None]:
    if _fused_ok(x, x.shape[-1]) and (residual is None or residual.stride(-1) == 1):
        return rms_norm_quant_triton(x, weight, eps, residual, kind, smooth, outliers, search,
                                     group)  # fmt: skip
    return rms_norm_quant_ref(x, weight, eps, residual, kind, smooth, outliers, search, group)


def silu_and_mul_quant(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> QuantAct:
    if _fused_ok(x, x.shape[-1] // 2):
        return silu_and_mul_quant_triton(x, kind, smooth, outliers, search, group)
    return silu_and_mul_quant_ref(x, kind, smooth, outliers, search, group)
