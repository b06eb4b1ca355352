"""x prepared for the float16-code int4 kernel (``scripts/experiments/int4_mma_f16.py``):
the layout, its torch reference, and SiLU·mul writing it directly (Triton). Not an engine
path yet: the experiment uses it to time that kernel with its input's real producer (see
docs/quantization.md, twenty-ninth session, for what adoption needs).

The kernel turns int4 codes into float16 ``1024 + q`` (even codes) and ``1024 + 16 q``
(odd codes) without shifting nibbles, so x is stored to match:

- rounded to float16, each odd value divided by 16 (exact: a power of two);
- within each word's eight values (one 32-bit word of codes) in the order the ``mma``
  fragments take them, ``ORDER``: values 0, 4, 1, 5, 2, 6, 3, 7 (the odd ones divided);
- with, per 128-value chunk and token, the float32 sums of the even values and of the
  divided odd values, ``sums[chunk, token, 0 | 1]`` (eight token slots; those past the
  step's tokens are not written by the kernel and not read for stored outputs), which
  take the zero point and the codes' 1024 off after the chunk's ``mma`` steps.

float16 holds up to 65,504: a larger value is infinite here (no guard yet)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.partials import SplitPartials, buffer, finished

ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Position p of a word's eight prepared values holds value ``ORDER[p]``."""
CHUNK = 128
MAX_TOKENS = 8


def prep_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M <= 8, K) real values (K a multiple of 128) -> (xq (M, K / 2) int32 of float16
    pairs, sums (K / 128, 8, 2) float32, token slots past M zero)."""
    m, k = x.shape
    if m > MAX_TOKENS or k % CHUNK:
        raise ValueError(f"x of shape {tuple(x.shape)}: at most 8 rows, K a multiple of 128")
    h = x.float().to(torch.float16).view(m, k // 8, 8)
    div = h.float().clone()
    div[..., 1::2] /= 16
    v = div.to(torch.float16)  # odd values / 16, rounded (exact but for subnormals)
    xq = v[..., list(ORDER)].contiguous().view(m, k).view(torch.int32)
    sums = torch.zeros(k // CHUNK, MAX_TOKENS, 2, dtype=torch.float32, device=x.device)
    c = v.float().view(m, k // CHUNK, CHUNK // 2, 2)
    sums[:, :m, 0] = c[..., 0].sum(-1).T
    sums[:, :m, 1] = c[..., 1].sum(-1).T
    return xq, sums


def unprep_ref(xq: torch.Tensor) -> torch.Tensor:
    """``prep_ref``'s xq back to (M, K) float32 in natural order, odd values still divided."""
    m = xq.shape[0]
    v = xq.contiguous().view(torch.float16).view(m, -1, 8).float()
    out = torch.empty_like(v)
    out[..., list(ORDER)] = v
    return out.view(m, -1)


@triton.jit
def _silu_mul_prep_kernel(x_ptr, xq_ptr, sum_ptr, stride_x, stride_q, inter, stride_s,
                          BLOCK: tl.constexpr, SPLIT: tl.constexpr = 0,
                          ROUND: tl.constexpr = 0):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter  # whole chunks: inter is a multiple of 128, BLOCK too
    if SPLIT == 0:
        g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    else:  # split-K partials (kiln.kernels.partials), summed in split order, then rounded
        g = tl.zeros((BLOCK,), dtype=tl.float32)
        u = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            base = x_ptr + s * stride_s + row * stride_x
            g += tl.load(base + offs, mask=mask, other=0.0)
            u += tl.load(base + inter + offs, mask=mask, other=0.0)
        if ROUND == 1:  # the partials' output dtype: bfloat16
            g = g.to(tl.bfloat16).to(tl.float32)
            u = u.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:  # float16
            g = g.to(tl.float16).to(tl.float32)
            u = u.to(tl.float16).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # as _silu_mul_kernel, in float32
    yh = y.to(tl.float16)
    code = offs % 8
    odd = (code % 2) == 1
    v = tl.where(odd, (yh.to(tl.float32) / 16.0).to(tl.float16), yh)
    # value `code` = 4 e + 2 h + b of a word goes to position 4 h + 2 b + e (ORDER inverted)
    pos = offs - code + ((code // 2) % 2) * 4 + (code % 2) * 2 + code // 4
    tl.store(xq_ptr + row * stride_q + pos, v, mask=mask)
    vf = v.to(tl.float32)
    se = tl.sum(tl.reshape(tl.where(odd, 0.0, vf), (BLOCK // 128, 128)), axis=1)
    so = tl.sum(tl.reshape(tl.where(odd, vf, 0.0), (BLOCK // 128, 128)), axis=1)
    chunk = tl.program_id(1) * (BLOCK // 128) + tl.arange(0, BLOCK // 128)
    cmask = chunk * 128 < inter
    tl.store(sum_ptr + chunk * 16 + row * 2, se, mask=cmask)
    tl.store(sum_ptr + chunk * 16 + row * 2 + 1, so, mask=cmask)


def silu_mul_prep_triton(x: torch.Tensor | SplitPartials) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU·mul of (M <= 8, 2I) [gate | up] (or its split-K partials), written as the
    float16-code kernel's x: ``prep_ref``'s (xq, sums) of ``silu(gate) * up`` computed in
    float32, in one kernel. Sums of token slots past M are left unwritten."""
    src, split = buffer(x)
    m, two_i = x.shape
    inter = two_i // 2
    if m > MAX_TOKENS or inter % CHUNK:
        raise ValueError(f"x of shape {(m, two_i)}: at most 8 rows, I a multiple of 128")
    xq = torch.empty(m, inter, dtype=torch.float16, device=src.device)
    sums = torch.empty(inter // CHUNK, MAX_TOKENS, 2, dtype=torch.float32, device=src.device)
    block = min(1024, triton.next_power_of_2(inter))
    rnd = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0) if split else 0
    _silu_mul_prep_kernel[(m, triton.cdiv(inter, block))](
        src, xq, sums, src.stride(-2), xq.stride(0), inter, src.stride(0) if split else 0,
        BLOCK=block, SPLIT=split, ROUND=rnd,
    )  # fmt: skip
    return xq.view(torch.int32), sums


def silu_mul_prep_ref(x: torch.Tensor | SplitPartials) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: SiLU·mul in float32 (partials summed and rounded as the engine
    does), then ``prep_ref``."""
    full = finished(x)
    g, u = full.float().chunk(2, dim=-1)
    return prep_ref(g / (1.0 + torch.exp(-g)) * u)
