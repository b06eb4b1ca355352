"""x prepared for the float16-code int4 kernel (``kiln.kernels.f16_prep``): the layout and
its range guard against an element-by-element construction, the kernel's arithmetic on it
against the int4 matmul, and SiLU·mul and RMSNorm writing it (Triton; the interpreter on
the CPU) against the references. Odd sizes: 3 and 8 tokens, 384 and 1,152 channels.

Triton against torch bit for bit where the result does not depend on the order of float32
sums: values built to be exact (the guard's boundaries). Otherwise the sums' and the mean's
orders differ (and on a GPU exp and rsqrt), so the stored values agree within a float16
step, the multipliers bit for bit, and the sums are those of the stored values. The
interpreter converts float32 to bfloat16 by truncation (torch and the GPU round to
nearest): up to two bfloat16 steps more there."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.f16_prep import (
    ORDER,
    guard_exponent,
    prep_ref,
    rms_norm_prep_ref,
    rms_norm_prep_triton,
    silu_mul_prep_ref,
    silu_mul_prep_triton,
    unprep_ref,
)
from kiln.kernels.partials import SplitPartials
from kiln.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from kiln.quant import formats as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRUNCATES = DEV == "cpu"  # the interpreter's float32 -> bfloat16


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's values as the layout keeps them (float16 of x / mult, times mult) and each
    chunk's mult (M, K / 128), from the guard's definition, one value at a time."""
    m, k = x.shape
    mult = torch.ones(m, k // 128)
    for i in range(m):
        for c in range(k // 128):
            amax = float(x[i, 128 * c : 128 * c + 128].float().abs().max())
            while amax > 16384 * mult[i, c]:
                mult[i, c] *= 2
    big = mult.repeat_interleave(128, 1)
    return (x.float() / big).half().float() * big, mult


def _big(m: int, k: int, seed: int) -> torch.Tensor:
    """Random (m, k) with some chunks scaled to need the guard: e = 1, 2 and 5."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    for i, (row, c, top) in enumerate([(0, 1, 20000.0), (m - 1, 0, 50000.0), (m // 2, 2, 4e5)]):
        if 128 * c < k and (i < 2 or m > 2):
            x[row, 128 * c : 128 * c + 128] *= top / x[row, 128 * c : 128 * c + 128].abs().max()
    return x


def _same(got: tuple, want: tuple, m: int, exact: bool, rtol: float = 2**-10) -> None:
    """(xq, sums) of the kernels against the reference's, token slots below m: the same
    bits, or the same multipliers and values within ``rtol`` (or a float16 subnormal
    step, at the chunk's scale); the sums are those of the stored values either way."""
    (xq, sums), (rq, rsums) = got, (t.to(got[0].device) for t in want)
    assert xq.shape == rq.shape and sums.shape == rsums.shape
    if exact:
        assert torch.equal(xq, rq)
        assert torch.equal(sums[:, :m], rsums[:, :m])
        return
    assert torch.equal(sums[:, :m, 2:], rsums[:, :m, 2:])
    mult = sums[:, :m, 2].T.repeat_interleave(128, 1)
    a, b = unprep_ref(xq, sums), unprep_ref(rq, rsums)
    assert bool(((a - b).abs() <= rtol * b.abs() + 2**-24 * mult).all())
    v = (a / mult).double().view(m, -1, 64, 2)
    size = v.abs().sum(2).transpose(0, 1)  # (chunks, m, 2)
    err = (sums[:, :m, :2].double() - v.sum(2).transpose(0, 1)).abs()
    assert bool((err <= 2e-6 * size).all())


def test_layout_element_by_element() -> None:
    x = _big(3, 384, 3)
    xq, sums = prep_ref(x)
    assert xq.dtype == torch.int32 and xq.shape == (3, 192)
    assert sums.dtype == torch.float32 and sums.shape == (3, 8, 4)
    v = xq.view(torch.float16).view(3, 384)
    _, mult = _rounded(x)
    assert mult[0, 1] == 2 and mult[2, 0] == 4 and mult[1, 2] == 32 and int(mult.sum()) == 6 + 38
    for m in range(3):
        for word in range(48):
            for p, src in enumerate(ORDER):
                div = mult[m, word // 16] * (16 if src % 2 else 1)
                assert v[m, 8 * word + p] == (x[m, 8 * word + src] / div).half()
    for c in range(3):
        for m in range(8):
            if m >= 3:
                assert torch.equal(sums[c, m], torch.zeros(4))
                continue
            lo, hi = 128 * c, 128 * c + 128
            even = (x[m, lo:hi:2] / mult[m, c]).half().float().sum()
            odd = (x[m, lo + 1 : hi : 2] / (16 * mult[m, c])).half().float().sum()
            assert torch.allclose(sums[c, m, 0], even, rtol=1e-6, atol=1e-6)
            assert torch.allclose(sums[c, m, 1], odd, rtol=1e-6, atol=1e-6)
            assert sums[c, m, 2] == mult[m, c] and sums[c, m, 3] == 0
    back = unprep_ref(xq, sums)
    want, _ = _rounded(x)
    assert torch.equal(back[:, 0::2], want[:, 0::2])
    # odd values: divided by 16 and rounded once (the same but for float16 subnormals)
    div = mult.repeat_interleave(64, 1)
    assert torch.equal(back[:, 1::2], (x[:, 1::2] / (16 * div)).half().float() * div)
    with pytest.raises(ValueError, match="at most 8 rows"):
        prep_ref(torch.zeros(9, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        prep_ref(torch.zeros(1, 200))


def test_guard_exponent_against_its_definition() -> None:
    tops = [0.0, 1e-45, 1e-30, 1.0, 16383.999, 16384.0, 16385.0, 32768.0, 32769.0, 65504.0]
    tops += [2.0**k * f for k in range(14, 128) for f in (1.0, 1.0 + 2**-23) if 2.0**k * f < 3.4e38]
    tops += [float(v) for v in torch.rand(200, generator=torch.Generator().manual_seed(1)) * 1e9]
    amax = torch.tensor(tops, dtype=torch.float32)
    want = []
    for a in amax.tolist():  # float32 values, exactly
        e = 0
        while a > 16384 * 2.0**e:
            e += 1
        want.append(e)
    assert guard_exponent(amax).tolist() == want
    odd = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert guard_exponent(odd).tolist() == [0, 0, 0]  # not finite: no division


def _boundary_y(m: int, k: int) -> torch.Tensor:
    """(m, k) exact values (float32, sums exact in any order) whose chunks' largest are
    on the guard's boundaries: 16,384 (mult 1), 16,385 (2), 32,768 (2), 32,769 (4),
    2**19 + 2**-4 (64), per token a different chunk."""
    gen = torch.Generator().manual_seed(m * k)
    y = torch.randint(-24, 25, (m, k), generator=gen).float() / 8
    tops = [16384.0, 16385.0, 32768.0, 32769.0, 524288.0625]
    for i in range(m):
        for c in range(k // 128):
            t = (i + c) % (len(tops) + 1)
            if t < len(tops):
                y[i, 128 * c + (7 * i + 3 * c) % 128] = tops[t] * (-1) ** (i + c)
    return y


def test_guard_boundaries_in_the_reference_and_the_kernels() -> None:
    m, k = 5, 768
    y = _boundary_y(m, k)
    want = prep_ref(y)
    _, mult = _rounded(y)
    assert torch.equal(want[1][:, :m, 2], mult.T)
    assert {float(v) for v in mult.flatten()} == {1.0, 2.0, 4.0, 64.0}
    # SiLU·mul: silu(128) is 128 exactly in float32, so y = 128 * (y / 128), exactly
    g = torch.full((m, k), 128.0)
    _same(silu_mul_prep_triton(torch.cat([g, y / 128], 1).to(DEV)), want, m, True)
    # RMSNorm: rows of +-2**-i (rsqrt 2**i, exactly, with eps 0) times a weight of y
    w = y[0].abs()
    signs = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    x = torch.stack([signs * 2.0**-i for i in range(m)])
    want = prep_ref((signs * w).expand(m, k))
    _same(rms_norm_prep_ref(x, w, 0.0)[0], want, m, True)
    _same(rms_norm_prep_triton(x.to(DEV), w.to(DEV), 0.0)[0], want, m, True)


@pytest.mark.parametrize("m,k", [(1, 256), (3, 384), (8, 1152)])
@pytest.mark.parametrize("guarded", [False, True])
def test_kernel_arithmetic_on_the_layout_is_the_int4_matmul(m: int, k: int, guarded: bool) -> None:
    """What the kernel computes per 128-code chunk, in natural order: the codes as
    ``1024 + q`` (even) and ``1024 + 16 q`` (odd) against the prepared values, less
    ``(1024 + zero)`` times the even sum and ``(1024 + 16 zero)`` times the odd sum, times
    the chunk's multiplier and the scale: the int4 matmul of x rounded as the layout
    keeps it (to float16, but for the guarded chunks' multipliers)."""
    gen = torch.Generator().manual_seed(m * k)
    n = 40
    w = torch.randn(n, k, generator=gen)
    q, s, z = qf.quantize_int4(w, 128)
    x = _big(m, k, m + k) if guarded else torch.randn(m, k, generator=gen)
    xq, sums = prep_ref(x)
    mult = sums[:, :m, 2].T.double()  # (m, chunks)
    assert bool((mult > 1).any()) == guarded
    xv = unprep_ref(xq, sums).double().view(m, k // 128, 128) / mult[..., None]  # stored
    odd = torch.arange(k) % 2 == 1
    a = torch.where(odd, 1024 + 16 * q.double(), 1024 + q.double())
    c = torch.einsum("nck,mck->mnc", a.view(n, k // 128, 128), xv)
    se, so = sums[:, :m, 0].T.double(), sums[:, :m, 1].T.double()  # (m, chunks)
    zf = z.double()
    y = c - (1024 + zf)[None] * se[:, None] - (1024 + 16 * zf)[None] * so[:, None]
    got = (mult[:, None] * y * s.double()[None]).sum(-1)
    deq = (q.double() - z.double().repeat_interleave(128, 1)) * s.double().repeat_interleave(128, 1)
    want = _rounded(x)[0].double() @ deq.T
    # exact but for the float32 sums' rounding, which the 1024 offsets amplify (the
    # kernel's own float32 accumulation does the same): 2e-6 of the largest output seen
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,inter", [(1, 128), (3, 384), (8, 1152)])
@pytest.mark.parametrize("split", [0, 3])
def test_silu_mul_writes_the_prepared_x(dtype: torch.dtype, m: int, inter: int, split: int) -> None:
    gen = torch.Generator().manual_seed(m + inter + split)
    if split:
        x = SplitPartials(torch.randn(split, m, 2 * inter, generator=gen).to(DEV), dtype)
    else:
        x = torch.randn(m, 2 * inter, generator=gen) * 2
        x[:, :inter] += 40 * (torch.arange(inter) < 128)  # first chunk: silu(g) ~ g
        x[:, inter:] *= 1 + 8000 * (torch.arange(inter) < 128)  # ~ 40 * 8000 * 2: guarded
        x = x.to(DEV, dtype)
    xq, sums = silu_mul_prep_triton(x)
    rq, rsums = silu_mul_prep_ref(x)
    if not split:
        assert bool((rsums[0, :m, 2] > 1).all()) and bool((rsums[1:, :m, 2] == 1).all())
    # one float16 step at most (the interpreter's exp and torch's may differ by an ulp)
    _same((xq, sums), (rq, rsums), m, False)
    with pytest.raises(ValueError, match="multiple of 128"):
        silu_mul_prep_triton(torch.zeros(1, 2 * 200, device=DEV))
    with pytest.raises(ValueError, match="at most 8 rows"):
        silu_mul_prep_triton(torch.zeros(9, 256, device=DEV))


def _norm_inputs(m: int, h: int, dtype: torch.dtype, split: int, residual: bool) -> tuple:
    gen = torch.Generator().manual_seed(m * h + split + residual)
    if split:
        x = SplitPartials(torch.randn(split, m, h, generator=gen).to(DEV), dtype)
    else:
        x = (torch.randn(m, h, generator=gen) * 2).to(DEV, dtype)
    w = (1 + torch.randn(h, generator=gen) / 4).to(DEV, dtype)
    r = torch.randn(m, h, generator=gen).to(DEV, dtype) if residual else None
    return x, w, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,h", [(1, 128), (3, 384), (8, 1152)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("split", [0, 2, 3])
def test_rms_norm_writes_the_prepared_x(
    dtype: torch.dtype, m: int, h: int, residual: bool, split: int
) -> None:
    x, w, r = _norm_inputs(m, h, dtype, split, residual)
    got, got_r = rms_norm_prep_triton(x, w, 1e-5, r)
    want, want_r = rms_norm_prep_ref(x, w, 1e-5, r)
    exact = dtype == torch.float32 or not TRUNCATES
    # bfloat16: the normalized value's rounding may go the other way (a last bit of the
    # mean or rsqrt), a step of 2**-7; on the interpreter, which truncates it and the
    # residual add, up to two steps; then float16's rounding
    steps = 0 if dtype == torch.float32 else 2 if TRUNCATES else 1
    _same(got, want, m, False, steps * 2**-7 + 2**-10)
    assert (got_r is None) == (not residual)
    if residual:
        # the same bits as the engine's kernel; torch's where it rounds the same way
        assert torch.equal(got_r, rms_norm_triton(x, w, 1e-5, r)[1])
        if exact:
            assert torch.equal(got_r, want_r)
    if split:  # partials added exactly as the reduction kernel does
        fin, fin_r = rms_norm_prep_triton(x.finish(), w, 1e-5, r)
        assert torch.equal(got[0], fin[0]) and torch.equal(got[1][:, :m], fin[1][:, :m])
        assert (fin_r is None) or torch.equal(fin_r, got_r)
    # the engine's RMSNorm, which rounds its output to x's dtype (bfloat16: one step more)
    ref, _ = rms_norm_ref(x.finish() if split else x, w, 1e-5, r)
    tol = (steps + (dtype != torch.float32)) * 2**-7 + 2**-10
    back = unprep_ref(*got)
    back[:, 1::2] *= 16
    assert torch.allclose(back, ref.float(), rtol=tol, atol=1e-6)


@pytest.mark.parametrize("size", [128, 256, 512])
def test_producers_pieces_give_the_same_bits(size: int) -> None:
    """Programs of fewer values (``block`` / ``piece``) write the same values as the default
    (each is one element's arithmetic, and every program of the RMSNorm producer sums the
    whole row's squares alike) and chunk sums of them (whose order may change with the
    layout); other warp counts stay within the reference's rounding."""
    x, w, r = _norm_inputs(3, 1152, torch.bfloat16, 0, True)
    want, want_r = rms_norm_prep_triton(x, w, 1e-5, r)
    got, got_r = rms_norm_prep_triton(x, w, 1e-5, r, piece=size)
    assert torch.equal(got[0], want[0]) and torch.equal(got_r, want_r)
    _same(got, want, 3, False, 0.0)
    got, _ = rms_norm_prep_triton(x, w, 1e-5, r, piece=size, num_warps=size // 128)
    _same(got, rms_norm_prep_ref(x, w, 1e-5, r)[0], 3, False, 2 * 2**-7 + 2**-10)
    gu = torch.randn(3, 2 * 1152, generator=torch.Generator().manual_seed(size)).to(DEV)
    gu = gu.bfloat16()
    want = silu_mul_prep_triton(gu)
    got = silu_mul_prep_triton(gu, block=size)
    assert torch.equal(got[0], want[0])
    _same(got, want, 3, False, 0.0)
    got = silu_mul_prep_triton(gu, block=size, num_warps=size // 128)
    _same(got, silu_mul_prep_ref(gu), 3, False)


def test_rms_norm_prep_guard_beyond_float16() -> None:
    """A norm weight that takes values past float16's 65,504: finite, the right values."""
    m, h = 3, 384
    x, _, r = _norm_inputs(m, h, torch.float32, 0, True)
    w = torch.ones(h, device=DEV)
    w[128:256] = 3e4  # RMS-normalized values reach 3 or so: 9e4 and more
    w[257::9] = -1e6
    (xq, sums), _ = rms_norm_prep_triton(x, w, 1e-6, r)
    assert bool(xq.view(torch.float16).isfinite().all())
    assert bool((sums[:, :m, 2] > 1).all(1)[1:].all()) and bool((sums[0, :m, 2] == 1).all())
    ref, _ = rms_norm_ref(x, w, 1e-6, r)
    assert float(ref.abs().max()) > 65504
    back = unprep_ref(xq, sums)
    back[:, 1::2] *= 16
    # float16's rounding relative to the value, or to the chunk's (odd values: 16 times
    # coarser) where it is subnormal
    step = 2**-20 * sums[:, :m, 2].T.repeat_interleave(128, 1)
    assert bool(((back - ref).abs() <= 2**-11 * ref.abs() + step).all())
    _same((xq, sums), rms_norm_prep_ref(x, w, 1e-6, r)[0], m, False)


def test_rms_norm_prep_errors() -> None:
    w = torch.ones(256, device=DEV)
    with pytest.raises(ValueError, match="at most 8 rows"):
        rms_norm_prep_triton(torch.zeros(9, 256, device=DEV), w, 1e-5)
    with pytest.raises(ValueError, match="multiple of 128"):
        rms_norm_prep_triton(torch.zeros(2, 200, device=DEV), w[:200], 1e-5)
    with pytest.raises(ValueError, match="at most 8 rows"):
        rms_norm_prep_ref(torch.zeros(9, 256), w.cpu(), 1e-5)


def test_values_not_finite_are_stored_as_they_are() -> None:
    """A chunk holding an infinite or NaN value keeps mult 1 (no division; its values are
    stored as they are), in the reference and the kernel alike; the others are guarded."""
    y = _boundary_y(2, 384)
    y[0, 5], y[1, 130] = float("inf"), float("nan")
    xq, sums = prep_ref(y)
    assert sums[:, :2, 2].T.tolist() == [[1.0, 2.0, 2.0], [2.0, 1.0, 4.0]]
    g = torch.full((2, 384), 128.0)
    got = silu_mul_prep_triton(torch.cat([g, y / 128], 1).to(DEV))
    assert torch.equal(got[1][:, :2, 2:].cpu(), sums[:, :2, 2:])
    nan = torch.zeros(2, 384, dtype=torch.bool)
    nan[1, 130] = True
    for v in (xq, got[0].cpu()):
        back = unprep_ref(v, sums)
        assert back[0, 5] == float("inf") and torch.equal(back.isnan(), nan)
