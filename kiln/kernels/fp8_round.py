"""fp8 e4m3 rounding inside Triton kernels, shared by the activation quantizers
(``kiln.kernels.quant_act``) and the fp8 KV-cache writes (``kiln.kernels.rotary``): the
saturated quotient x / scale, its e4m3 code (exact under the CPU interpreter too), and the
scale searches of ``--act-scale-search`` (one row's, or each group's at once), which do
the scalar arithmetic of ``quant_act_ref.search_fp8_scale`` in its order."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_quotient(x, scale, EMULATE: tl.constexpr):
    """x / scale (float32, correctly rounded), saturated to +-448. Compiled, the quotient is
    x * (1 / scale) corrected by one fma, with 1 / scale correctly rounded (Markstein's
    theorem: the correctly rounded quotient, away from underflow, where e4m3 gives 0 either
    way): 3 operations an element where a correctly rounded division takes about a dozen,
    a scalar reciprocal when the scale is one (a row's, a layer's). The interpreter divides
    (``test_to_fp8_markstein`` checks the identity on the CPU)."""
    if EMULATE:
        y = tl.math.div_rn(x, scale)
    else:
        inv = tl.math.div_rn(1.0, scale)
        y0 = x * inv
        y = tl.math.fma(tl.math.fma(-y0, scale, x), inv, y0)
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def fp8_code(y, EMULATE: tl.constexpr):
    """float32 y within +-448 as e4m3 (nearest even)."""
    if EMULATE:
        # the Triton interpreter's float32 -> e4m3 conversion mis-rounds (ties away from
        # zero, and a carry into the exponent is lost): round onto the e4m3 grid here, in
        # float32 (the step is a power of two, 2**-9 for subnormals; adding and taking away
        # 1.5 * 2**23 rounds to an integer, ties to even; the sign is kept, -0 included), so
        # the conversion is exact
        a = tl.abs(y)
        step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)
        r = ((a / step + 12582912.0) - 12582912.0) * step
        y = tl.where(y < 0, -r, r)
    return y.to(tl.float8e4nv)


@triton.jit
def to_fp8(x, scale, EMULATE: tl.constexpr):
    """x / scale (``fp8_quotient``) as e4m3, nearest even."""
    return fp8_code(fp8_quotient(x, scale, EMULATE), EMULATE)


@triton.jit
def search_scale(y, amax, scale0, EMULATE: tl.constexpr, SEARCH: tl.constexpr,
                 TOP: tl.constexpr):  # fmt: skip
    """``quant_act_ref.search_fp8_scale`` for one row ``y`` (0 past the row) of largest
    magnitude ``amax``: its TOP largest distinct magnitudes (TOP - 1 more max passes, |y|
    recomputed in each rather than held beside y in registers), then the SEARCH
    candidates side by side, each scored on those values in the reference's order (no
    contracted multiply-adds: the launch turns fp fusion off), the first of least cost
    kept."""
    j = tl.arange(0, SEARCH)
    s = scale0 * (1.0 + j.to(tl.float32) / SEARCH)
    inv = tl.math.div_rn(1.0, s)
    m = amax
    v = m * inv
    d = fp8_code(v, EMULATE).to(tl.float32) - v
    cost = d * d
    for _ in tl.static_range(TOP - 1):
        m = tl.max(tl.where(tl.abs(y) < m, tl.abs(y), 0.0), axis=0)
        v = m * inv
        d = fp8_code(v, EMULATE).to(tl.float32) - v
        cost = cost + d * d
    cost = cost * ((SEARCH + j) * (SEARCH + j)).to(tl.float32)
    best = tl.argmin(cost, axis=0, tie_break_left=True)
    return tl.sum(tl.where(j == best, s, 0.0), axis=0)


@triton.jit
def search_group_scales(a2, gmax, scale0, EMULATE: tl.constexpr, SEARCH: tl.constexpr,
                        TOP: tl.constexpr):  # fmt: skip
    """``search_scale`` for each group at once: ``a2`` (NG, GROUP) the groups' magnitudes
    (0 past the row), ``gmax`` and ``scale0`` (NG,) their largest and their amax / 448;
    the candidates (NG, SEARCH) scored on each group's TOP largest distinct magnitudes in
    the reference's order, the first of least cost kept per group."""
    j = tl.arange(0, SEARCH)
    s = scale0[:, None] * (1.0 + j.to(tl.float32) / SEARCH)[None, :]
    inv = tl.math.div_rn(1.0, s)
    m = gmax
    v = m[:, None] * inv
    d = fp8_code(v, EMULATE).to(tl.float32) - v
    cost = d * d
    for _ in tl.static_range(TOP - 1):
        m = tl.max(tl.where(a2 < m[:, None], a2, 0.0), axis=1)
        v = m[:, None] * inv
        d = fp8_code(v, EMULATE).to(tl.float32) - v
        cost = cost + d * d
    cost = cost * ((SEARCH + j) * (SEARCH + j)).to(tl.float32)[None, :]
    best = tl.argmin(cost, axis=1, tie_break_left=True)
    return tl.sum(tl.where(j[None, :] == best[:, None], s, 0.0), axis=1)
