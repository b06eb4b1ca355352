"""Rotary position embedding in the half-split (Hugging Face) layout, alone and fused with
the paged KV-cache write: Triton kernel, its launcher, the torch references, the dispatcher.

``cos_sin`` is the (max_positions, D) float32 table ``[cos(f) | sin(f)]``, f = pos *
inv_freq, built by ``kiln.layers.rotary.RotaryEmbedding`` (any frequency scaling is already
in it). The KV cache of one layer is (2, num_blocks, tokens_per_block, Hk, D); a token's
flat slot is ``block * tokens_per_block + offset``, and a slot of -1 means "write nothing"
(padding tokens of a captured CUDA graph)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._triton import INTERPRET, use_triton
from kiln.kernels.attention import KvScale, fp8_scales, write_kv_ref
from kiln.kernels.quant_act import to_fp8


def apply_rotary_ref(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hk, D)
    positions: torch.Tensor,  # (T,) int64
    cos_sin: torch.Tensor,  # (max_positions, D) float32: [cos(f) | sin(f)], f = pos * inv_freq
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions; computed in float32, returned in the input dtype."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions]  # (T, D)
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1).unsqueeze(1)  # (T, 1, D)
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1).unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    return rot(q), rot(k)


apply_rotary = apply_rotary_ref


def rotary_write_kv_ref(
    qkv: torch.Tensor,  # (T, (Hq + 2 Hk) * D): the fused projection, laid out [q | k | v]
    positions: torch.Tensor,  # (T,) int64
    cos_sin: torch.Tensor,  # (max_positions, D) float32
    kv_cache: torch.Tensor,  # (2, num_blocks, tokens_per_block, Hk, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = do not write this token
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: KvScale = None,  # an fp8 cache's (k, v) scales
) -> torch.Tensor:
    """Rotate q and k (``apply_rotary_ref``), write rotated k and raw v to the cache
    (``write_kv_ref``, skipping slots of -1; an fp8 cache quantizes them from the input
    dtype) and return the rotated q, (T, Hq, D)."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(t, num_heads, head_dim)
    k = k.view(t, num_kv_heads, head_dim)
    v = v.view(t, num_kv_heads, head_dim)
    q, k = apply_rotary_ref(q, k, positions, cos_sin)
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # a host sync: fine for the reference, never graph-captured
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    write_kv_ref(k, v, kv_cache, slot_mapping, kv_scale)
    return q


@triton.jit
def _rotary_kv_kernel(
    qkv_ptr,
    pos_ptr,
    cs_ptr,
    slot_ptr,
    q_out_ptr,
    kv_ptr,
    ks_ptr,
    stride_t,
    stride_cs,
    stride_qo_t,
    stride_qo_h,
    stride_kind,
    stride_kb,
    stride_kt,
    stride_kh,
    HQ,
    HK,
    BS,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    Q_BLOCKS: tl.constexpr,
    FP8: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)  # head block: the first Q_BLOCKS are q heads, the rest kv heads
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=jm, other=0.0)[None, :]  # (1, HALF_PAD)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=jm, other=0.0)[None, :]
    h = tl.arange(0, BLOCK_H)
    row = qkv_ptr + tok * stride_t
    # each branch calls its own function: Triton merges variables assigned in both arms of
    # a run-time `if`, and these differ in type (pointers to q_out vs the cache)
    if hb < Q_BLOCKS:
        _rotate_q(row, q_out_ptr, tok, hb * BLOCK_H + h, j, jm, cos, sin, stride_qo_t,
                  stride_qo_h, HQ, D, HALF)  # fmt: skip
    else:
        _rotate_k_copy_v(row, kv_ptr, ks_ptr, slot_ptr, tok, (hb - Q_BLOCKS) * BLOCK_H + h, j,
                         jm, cos, sin, stride_kind, stride_kb, stride_kt, stride_kh, HQ, HK, BS,
                         D, HALF, FP8, EMULATE_FP8)  # fmt: skip


@triton.jit
def _rotate_q(row, q_out_ptr, tok, heads, j, jm, cos, sin, stride_qo_t, stride_qo_h, HQ,
              D: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    m = (heads < HQ)[:, None] & jm[None, :]
    src = row + heads[:, None] * D + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    dst = q_out_ptr + tok * stride_qo_t + heads[:, None] * stride_qo_h + j[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotate_k_copy_v(row, kv_ptr, ks_ptr, slot_ptr, tok, heads, j, jm, cos, sin, stride_kind,
                     stride_kb, stride_kt, stride_kh, HQ, HK, BS, D: tl.constexpr,
                     HALF: tl.constexpr, FP8: tl.constexpr,
                     EMULATE_FP8: tl.constexpr):  # fmt: skip
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    valid = slot >= 0  # -1: a padding token, its cache slot is left alone
    safe = tl.maximum(slot, 0)
    m = (heads < HK)[:, None] & jm[None, :] & valid
    src = row + HQ * D + heads[:, None] * D + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    dst = kv_ptr + (safe // BS) * stride_kb + (safe % BS) * stride_kt
    dst += heads[:, None] * stride_kh + j[None, :]
    # round as the reference does: to the input dtype, then to the cache's
    ty = row.dtype.element_ty
    cty = kv_ptr.dtype.element_ty
    if FP8:  # quantized from the input dtype's value, as the reference does
        ks = tl.load(ks_ptr)
        vs = tl.load(ks_ptr + 1)
        k1 = to_fp8((x1 * cos - x2 * sin).to(ty).to(tl.float32), ks, EMULATE_FP8)
        k2 = to_fp8((x2 * cos + x1 * sin).to(ty).to(tl.float32), ks, EMULATE_FP8)
        tl.store(dst, k1, mask=m)
        tl.store(dst + HALF, k2, mask=m)
        src += HK * D
        dst += stride_kind
        v1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        v2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(dst, to_fp8(v1, vs, EMULATE_FP8), mask=m)
        tl.store(dst + HALF, to_fp8(v2, vs, EMULATE_FP8), mask=m)
    else:
        tl.store(dst, (x1 * cos - x2 * sin).to(ty).to(cty), mask=m)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty).to(cty), mask=m)
        # v is copied unrotated, in the same two halves (D = 2 * HALF)
        src += HK * D
        dst += stride_kind
        tl.store(dst, tl.load(src, mask=m, other=0.0).to(cty), mask=m)
        tl.store(dst + HALF, tl.load(src + HALF, mask=m, other=0.0).to(cty), mask=m)


def rotary_write_kv_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: KvScale = None,
) -> torch.Tensor:
    """Same contract as ``rotary_write_kv_ref``, in one launch. Needs qkv, cos_sin and the
    cache contiguous in their last dim, and an even head_dim (the half-split layout).
    Grid: (token, head block); a program rotates BLOCK_H q heads into the output, or rotates
    BLOCK_H k heads and copies their v heads into the token's cache slot."""
    t = qkv.shape[0]
    d = head_dim
    assert d % 2 == 0 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d
    assert qkv.stride(-1) == 1 and cos_sin.stride(-1) == 1 and kv_cache.stride(-1) == 1
    q_out = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    s = fp8_scales(kv_cache, kv_scale)
    if t == 0:
        return q_out
    half_pad = triton.next_power_of_2(d // 2)
    block_h = min(triton.next_power_of_2(max(num_heads, num_kv_heads)), max(1, 1024 // half_pad))
    q_blocks = triton.cdiv(num_heads, block_h)
    grid = (t, q_blocks + triton.cdiv(num_kv_heads, block_h))
    _rotary_kv_kernel[grid](
        qkv,
        positions,
        cos_sin,
        slot_mapping,
        q_out,
        kv_cache,
        s if s is not None else cos_sin,  # any float32 pointer when unused
        qkv.stride(0),
        cos_sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_heads,
        num_kv_heads,
        kv_cache.shape[2],
        D=d,
        HALF=d // 2,
        HALF_PAD=half_pad,
        BLOCK_H=block_h,
        Q_BLOCKS=q_blocks,
        FP8=s is not None,
        EMULATE_FP8=INTERPRET,
        num_warps=4,
    )
    return q_out


def rotary_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: KvScale = None,
) -> torch.Tensor:
    """Dispatcher: the fused Triton kernel on CUDA, the reference elsewhere."""
    args = (qkv, positions, cos_sin, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim)
    args += (kv_scale,)
    unit = qkv.stride(-1) == 1 and cos_sin.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if use_triton(qkv) and unit and head_dim % 2 == 0:
        return rotary_write_kv_triton(*args)
    return rotary_write_kv_ref(*args)
