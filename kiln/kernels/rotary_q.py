"""Rotary embedding of a prompt's query heads (optionally times the KV rotation's Hadamard
matrix), token-blocked: the q half of ``kiln.kernels.rotary.rotary_write_kv_triton`` for
many tokens.

The fused kernel there takes rows of (token, head) pairs, so a program of 64 rows covers
two tokens and reloads their cos/sin rows for each of the 32 heads, and reloads the sign
matrix for every 64 rows. Here a program owns ``BT`` consecutive tokens and ``HEADS``
heads: it loads the tokens' cos/sin rows and (with the rotation) the two halves of the
+-1 matrix once, then loops over its heads, each a (BT, D) tile in and out. The rounding
is the fused kernel's and the reference's: rotary in float32, rounded to the input dtype,
then the product with the signs in float32, times 1 / sqrt(D), rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._triton import INTERPRET

BT = 16
"""Tokens per program (the dot's rows: at least 16)."""
HEADS = 8
"""Query heads per program (heads past the last are masked)."""


@triton.jit
def _rotary_q_kernel(
    qkv_ptr,
    pos_ptr,
    cs_ptr,
    q_out_ptr,
    r_ptr,
    inv_sqrt_d,
    T,
    HQ,
    stride_t,
    stride_cs,
    stride_qo_t,
    stride_qo_h,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BT: tl.constexpr,
    HEADS: tl.constexpr,
    ROTATE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    live = tok < T
    tok64 = tl.where(live, tok, 0).to(tl.int64)
    pos = tl.load(pos_ptr + tok64).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    m = live[:, None] & jm[None, :]
    cs = cs_ptr + pos[:, None] * stride_cs + j[None, :]
    cos = tl.load(cs, mask=jm[None, :], other=0.0)  # (BT, HALF_PAD) float32
    sin = tl.load(cs + HALF, mask=jm[None, :], other=0.0)
    src = qkv_ptr + tok64[:, None] * stride_t + j[None, :]
    dst = q_out_ptr + tok64[:, None] * stride_qo_t
    ty = q_out_ptr.dtype.element_ty
    if ROTATE:  # a power-of-two head (HALF_PAD == HALF): the halves of the sign matrix
        jh = tl.arange(0, HALF)
        cols = tl.arange(0, D)
        s1 = tl.load(r_ptr + jh[:, None] * D + cols[None, :])
        s2 = tl.load(r_ptr + (jh + HALF)[:, None] * D + cols[None, :])
        if UPCAST:  # the interpreter multiplies bfloat16 dot operands as raw integers
            s1, s2 = s1.to(tl.float32), s2.to(tl.float32)
    h0 = tl.program_id(1) * HEADS
    for i in tl.static_range(HEADS):
        h = h0 + i
        hm = m & (h < HQ)
        x1 = tl.load(src + h * D, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * D + HALF, mask=hm, other=0.0).to(tl.float32)
        a1 = (x1 * cos - x2 * sin).to(ty)
        a2 = (x2 * cos + x1 * sin).to(ty)
        out = dst + h * stride_qo_h
        if ROTATE:
            if UPCAST:
                a1, a2 = a1.to(tl.float32), a2.to(tl.float32)
            y = tl.dot(a1, s1, input_precision=PRECISION)
            y = (tl.dot(a2, s2, y, input_precision=PRECISION) * inv_sqrt_d).to(ty)
            tl.store(out + cols[None, :], y, mask=live[:, None] & (h < HQ))
        else:
            tl.store(out + j[None, :], a1, mask=hm)
            tl.store(out + HALF + j[None, :], a2, mask=hm)


def rotary_q_triton(
    qkv: torch.Tensor,  # (T, (Hq + 2 Hk) * D), q first
    positions: torch.Tensor,  # (T,) int64
    cos_sin: torch.Tensor,  # (max_positions, D) float32
    q_out: torch.Tensor,  # (T, Hq, D), written
    signs: torch.Tensor | None,  # (D, D) +-1 in qkv's dtype, or None: no Hadamard product
    block_tokens: int = BT,
    heads_per_program: int = HEADS,
) -> None:
    """Rotate the query heads of ``qkv`` by their positions (then, with ``signs``, multiply
    by ``signs / sqrt(D)``) into ``q_out``: ``rotary_write_kv_ref``'s q. Needs unit stride
    in the last dims; with ``signs`` a power-of-two D of at least 32."""
    t, hq, d = q_out.shape
    if t == 0:
        return
    upcast = INTERPRET or qkv.dtype == torch.float32
    grid = (triton.cdiv(t, block_tokens), triton.cdiv(hq, heads_per_program))
    _rotary_q_kernel[grid](
        qkv,
        positions,
        cos_sin,
        q_out,
        signs if signs is not None else qkv,  # any pointer when unused
        d**-0.5,
        t,
        hq,
        qkv.stride(0),
        cos_sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        D=d,
        HALF=d // 2,
        HALF_PAD=triton.next_power_of_2(d // 2),
        BT=block_tokens,
        HEADS=heads_per_program,
        ROTATE=signs is not None,
        UPCAST=upcast,
        PRECISION="ieee" if upcast else "tf32",
        num_warps=4,
    )
