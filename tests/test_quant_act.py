"""Per-token activation quantization kernels (alone, fused into RMSNorm, fused into
SiLU-and-mul) against their torch references, fresh random inputs, odd sizes, fp8 and int8,
with and without smoothing factors. Interpreter on the CPU, compiled on a GPU.

Criterion: the scales agree to 2^-7 relative (the row amax is of values rounded to x's
dtype, which may differ by an ulp where the kernel's float32 ops differ from torch's);
every element's dequantized value is within one quantization step of the reference's; and
at least 99 % of the quantized codes are identical. bfloat16 runs on the GPU only: the
interpreter's float32 -> bfloat16 conversion truncates, so the chain of roundings the
kernels share with torch cannot match there (float32 exercises the same code paths)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import quant_act as qa

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
ROWS = [(1, 16), (3, 577), (9, 1536)] + ([(257, 4096), (100, 14336)] if DEV == "cuda" else [])


def _check(got: qa.QuantAct, ref: qa.QuantAct, kind: str) -> None:
    assert got.q.dtype == ref.q.dtype and got.q.shape == ref.q.shape
    assert got.scale.shape == ref.scale.shape == (ref.q.shape[0], 1)
    assert torch.allclose(got.scale, ref.scale, rtol=2**-7, atol=0)
    a, b = got.q.float() * got.scale, ref.q.float() * ref.scale
    if kind == "fp8":  # one e4m3 step: 2^-3 of the value's binade (2^-9 below 2^-6)
        mag = (b.abs() / ref.scale).clamp(min=2**-6)
        step = 2.0 ** (torch.floor(torch.log2(mag)) - 3) * ref.scale
    else:
        step = ref.scale.expand_as(b)
    assert bool(((a - b).abs() <= step * 1.01 + 1e-12).all())
    same = (got.q.float() == ref.q.float()).float().mean().item()
    assert same >= 0.99, f"only {same:.4f} of the codes match"


def _smooth(k: int, on: bool) -> torch.Tensor | None:
    return torch.rand(k, device=DEV) * 4 + 0.25 if on else None


@pytest.mark.parametrize("kind", qa.KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", ROWS)
@pytest.mark.parametrize("smooth", [False, True])
def test_quantize_rows(kind: str, dtype: torch.dtype, m: int, k: int, smooth: bool) -> None:
    x = (torch.randn(m, k, device=DEV) * torch.rand(m, 1, device=DEV) * 10).to(dtype)
    x[0, k // 2] = 60.0  # an outlier channel
    s = _smooth(k, smooth)
    got, ref = qa.quantize_rows_triton(x, kind, s), qa.quantize_rows_ref(x, kind, s)
    _check(got, ref, kind)


@pytest.mark.parametrize("kind", qa.KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", ROWS)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quant(kind: str, dtype: torch.dtype, m: int, k: int, residual: bool) -> None:
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    w = (torch.rand(k, device=DEV) + 0.5).to(dtype)
    r = torch.randn(m, k, device=DEV, dtype=dtype) if residual else None
    s = _smooth(k, kind == "int8")
    got, got_r = qa.rms_norm_quant_triton(x, w, 1e-5, r, kind, s)
    ref, ref_r = qa.rms_norm_quant_ref(x, w, 1e-5, r, kind, s)
    _check(got, ref, kind)
    if residual:
        assert torch.equal(got_r, ref_r)
    else:
        assert got_r is None


@pytest.mark.parametrize("kind", qa.KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,i", [(1, 16), (5, 771)] + ([(64, 14336)] if DEV == "cuda" else []))
def test_silu_and_mul_quant(kind: str, dtype: torch.dtype, m: int, i: int) -> None:
    x = (torch.randn(m, 2 * i, device=DEV) * 3).to(dtype)
    s = _smooth(i, kind == "int8")
    got, ref = qa.silu_and_mul_quant_triton(x, kind, s), qa.silu_and_mul_quant_ref(x, kind, s)
    _check(got, ref, kind)


def test_zero_rows_and_empty() -> None:
    x = torch.zeros(3, 40, device=DEV)
    for kind in qa.KINDS:
        got = qa.quantize_rows_triton(x, kind)
        assert not got.q.float().any() and bool((got.scale > 0).all())
        assert qa.quantize_rows_triton(x[:0], kind).q.shape == (0, 40)


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="int4"):
        qa.quantize_rows_triton(torch.ones(1, 8, device=DEV), "int4")


def test_dispatch_on_cpu_is_the_reference() -> None:
    if DEV == "cuda":
        pytest.skip("CPU-only check")
    x = torch.randn(4, 32)
    got, ref = qa.quantize_rows(x, "fp8"), qa.quantize_rows_ref(x, "fp8")
    assert torch.equal(got.q.float(), ref.q.float()) and torch.equal(got.scale, ref.scale)
