"""Triton kernels against their torch references, fresh random inputs, odd sizes. On the
CPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
on a GPU the same tests run the compiled kernels at real sizes too.
Tolerances, relative to the largest output: float32 1e-5; bfloat16 4 ulp (2^-6): the
kernels round once where the references round after each op, and the interpreter's
bfloat16 rounding differs from the GPU's."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kiln.kernels.rmsnorm import rms_norm_ref, rms_norm_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8}
SIZES = [(1, 8), (3, 769), (17, 576)] + ([(257, 4096), (1000, 5120)] if DEV == "cuda" else [])


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = b.float().abs().max().clamp_min(1e-30)
    rel = float((a.float() - b.float()).abs().max() / scale)
    assert rel <= TOL[dtype], f"relative error {rel:.3e} > {TOL[dtype]:.1e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h", SIZES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(dtype: torch.dtype, t: int, h: int, with_residual: bool) -> None:
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    w = torch.randn(h, device=DEV, dtype=dtype)
    r = torch.randn(t, h, device=DEV, dtype=dtype) if with_residual else None
    out, res = rms_norm_triton(x, w, 1e-5, r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
    _close(out, ref, dtype)
    if with_residual:
        _close(res, ref_res, dtype)
    else:
        assert res is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,i", [(1, 3), (5, 771), (9, 1536)] + ([(513, 14336)] if DEV == "cuda" else [])
)
def test_silu_and_mul_kernel(dtype: torch.dtype, t: int, i: int) -> None:
    x = torch.randn(t, 2 * i, device=DEV, dtype=dtype) * 3
    _close(silu_and_mul_triton(x), silu_and_mul_ref(x), dtype)


def test_strided_rows() -> None:
    """A row stride larger than the row (a view into a wider tensor) is honoured."""
    base = torch.randn(6, 200, device=DEV)
    x = base[:, :150]
    w = torch.randn(150, device=DEV)
    _close(rms_norm_triton(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6)[0], torch.float32)
