"""x prepared for the float16-code int4 kernel (``kiln.kernels.f16_prep``): the layout
against an element-by-element construction, the kernel's arithmetic on it against the
int4 matmul, and SiLU·mul writing it (Triton; the interpreter on the CPU) against the
reference. Odd sizes: 3 and 8 tokens, 384 and 1,152 channels."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.f16_prep import (
    ORDER,
    prep_ref,
    silu_mul_prep_ref,
    silu_mul_prep_triton,
    unprep_ref,
)
from kiln.kernels.partials import SplitPartials
from kiln.quant import formats as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_layout_element_by_element() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=gen) * 3
    xq, sums = prep_ref(x)
    assert xq.dtype == torch.int32 and xq.shape == (3, 128)
    v = xq.view(torch.float16).view(3, 256)
    h = x.to(torch.float16)
    for m in range(3):
        for word in range(32):
            for p, src in enumerate(ORDER):
                want = h[m, 8 * word + src]
                if src % 2:
                    want = (want.float() / 16).to(torch.float16)
                assert v[m, 8 * word + p] == want
    for c in range(2):
        for m in range(8):
            lo, hi = 128 * c, 128 * c + 128
            even = h[m, lo:hi:2].float().sum() if m < 3 else torch.tensor(0.0)
            odd = (h[m, lo + 1 : hi : 2].float() / 16).half().float().sum() if m < 3 else 0.0
            assert torch.allclose(sums[c, m, 0], even, rtol=1e-6, atol=1e-6)
            assert torch.allclose(sums[c, m, 1], torch.as_tensor(odd), rtol=1e-6, atol=1e-6)
    back = unprep_ref(xq)
    assert torch.equal(back[:, 0::2], h[:, 0::2].float())
    with pytest.raises(ValueError, match="at most 8 rows"):
        prep_ref(torch.zeros(9, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        prep_ref(torch.zeros(1, 200))


@pytest.mark.parametrize("m,k", [(1, 256), (3, 384), (8, 1152)])
def test_kernel_arithmetic_on_the_layout_is_the_int4_matmul(m: int, k: int) -> None:
    """What the kernel computes per 128-code chunk, in natural order: the codes as
    ``1024 + q`` (even) and ``1024 + 16 q`` (odd) against the prepared values, less
    ``(1024 + zero)`` times the even sum and ``(1024 + 16 zero)`` times the odd sum, times
    the scale: the int4 matmul of x rounded to float16."""
    gen = torch.Generator().manual_seed(m * k)
    n = 40
    w = torch.randn(n, k, generator=gen)
    q, s, z = qf.quantize_int4(w, 128)
    x = torch.randn(m, k, generator=gen)
    xq, sums = prep_ref(x)
    xv = unprep_ref(xq).double()  # odd values divided by 16
    odd = torch.arange(k) % 2 == 1
    a = torch.where(odd, 1024 + 16 * q.double(), 1024 + q.double())
    c = torch.einsum("nck,mck->mnc", a.view(n, k // 128, 128), xv.view(m, k // 128, 128))
    se, so = sums[:, :m, 0].T.double(), sums[:, :m, 1].T.double()  # (m, chunks)
    zf = z.double()
    y = c - (1024 + zf)[None] * se[:, None] - (1024 + 16 * zf)[None] * so[:, None]
    got = (y * s.double()[None]).sum(-1)
    deq = (q.double() - z.double().repeat_interleave(128, 1)) * s.double().repeat_interleave(128, 1)
    want = x.to(torch.float16).double() @ deq.T
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
        x = (torch.randn(m, 2 * inter, generator=gen) * 2).to(DEV, dtype)
    xq, sums = silu_mul_prep_triton(x)
    rq, rsums = silu_mul_prep_ref(x)
    got, want = unprep_ref(xq), unprep_ref(rq)
    # one float16 step at most (the interpreter's exp and torch's may differ by an ulp)
    assert torch.allclose(got, want, rtol=2**-10, atol=1e-7)
    assert torch.allclose(sums[:, :m], rsums[:, :m], rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="multiple of 128"):
        silu_mul_prep_triton(torch.zeros(1, 2 * 200, device=DEV))
    with pytest.raises(ValueError, match="at most 8 rows"):
        silu_mul_prep_triton(torch.zeros(9, 256, device=DEV))
