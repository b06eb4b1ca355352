"""Rotary position embedding in the half-split (Hugging Face) layout, alone and fused with
the paged KV-cache write: Triton kernel, its launcher and the dispatcher (the torch references
live in ``kiln.kernels.rotary_ref`` and are re-exported here).

``cos_sin`` is the (max_positions, D) float32 table ``[cos(f) | sin(f)]``, f = pos *
inv_freq, built by ``kiln.layers.rotary.RotaryEmbedding`` (any frequency scaling is already
in it). The KV cache of one layer is (2, num_blocks, tokens_per_block, Hk, D); a token's
flat slot is ``block * tokens_per_block + offset``, and a slot of -1 means "write nothing"
(padding tokens of a captured CUDA graph)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import pdl
from kiln.kernels._triton import INTERPRET, use_triton
from kiln.kernels.attention import KvScale, fp8_scales
from kiln.kernels.fp8_round import to_fp8
from kiln.kernels.hadamard import kv_rotation_allowed
from kiln.kernels.rotary_ref import apply_rotary, apply_rotary_ref, rotary_write_kv_ref

__all__ = ["apply_rotary", "apply_rotary_ref", "rotary_write_kv", "rotary_write_kv_ref",
           "rotary_write_kv_triton"]  # fmt: skip


@triton.jit
def _rotary_kv_kernel(
    qkv_ptr,
    pos_ptr,
    cs_ptr,
    slot_ptr,
    q_out_ptr,
    kv_ptr,
    ks_ptr,
    r_ptr,
    inv_sqrt_d,
    stride_t,
    stride_cs,
    stride_qo_t,
    stride_qo_h,
    stride_kind,
    stride_kb,
    stride_kt,
    stride_kh,
    T,
    HQ,
    HK,
    BS,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP8: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    PART: tl.constexpr,
    PDL: tl.constexpr = 0,
    FRESH_K: tl.constexpr = False,
):
    # kiln.kernels.pdl: the wait follows the loads of the positions and their cos / sin,
    # which no kernel of the step writes
    pdl.pdl_enter(PDL >= 1, False)
    # rows: in the first programs BLOCK_R consecutive (token, q head) pairs, so that no row
    # is padding but the last program's; in the rest BLOCK_R consecutive tokens of one kv
    # head, so that an fp8 cache's transposed value stores of a warp land on consecutive
    # bytes of a block when the slots are a prompt's (with (token, head) rows a warp's 32
    # bytes fell in 8 heads' tiles; H200, 2026-12-02: the kv programs of a 16,384-token
    # prompt 203 -> 160 us; over scattered slots no change, 365-389 us).
    # PART 0: both kinds in one launch; 1: the q programs only; 2: the kv programs only
    q_progs = tl.cdiv(T * HQ, BLOCK_R)
    pid = tl.program_id(0)
    if PART == 2:
        pid += q_progs
    is_q = pid < q_progs
    r = tl.arange(0, BLOCK_R)
    kv_pid = pid - q_progs
    tiles = tl.cdiv(T, BLOCK_R)
    idx = (pid * BLOCK_R + r).to(tl.int64)
    tok = tl.where(is_q, idx // HQ, (kv_pid % tiles) * BLOCK_R + r)
    heads = tl.where(is_q, idx % HQ, kv_pid // tiles)
    live = tok < T
    tok = tl.where(live, tok, 0)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    cs = cs_ptr + pos[:, None] * stride_cs + j[None, :]
    cos = tl.load(cs, mask=jm[None, :], other=0.0)  # (BLOCK_R, HALF_PAD)
    sin = tl.load(cs + HALF, mask=jm[None, :], other=0.0)
    pdl.pdl_enter(False, PDL >= 2)
    row = qkv_ptr + tok[:, None] * stride_t
    # each branch calls its own function: Triton merges variables assigned in both arms of
    # a run-time `if`, and these differ in type (pointers to q_out vs the cache)
    if PART == 1:
        _rotate_q(row, q_out_ptr, r_ptr, inv_sqrt_d, tok[:, None], heads, live, j, jm, cos,
                  sin, stride_qo_t, stride_qo_h, D, HALF, ROTATE, UPCAST, PRECISION)  # fmt: skip
    elif PART == 2:
        _rotate_k_copy_v(row, kv_ptr, ks_ptr, slot_ptr, r_ptr, inv_sqrt_d, tok, heads, live, j,
                         jm, cos, sin, stride_kind, stride_kb, stride_kt, stride_kh, HQ, HK,
                         BS, D, HALF, FP8, EMULATE_FP8, ROTATE, UPCAST, PRECISION,
                         FRESH_K)  # fmt: skip
    elif is_q:
        _rotate_q(row, q_out_ptr, r_ptr, inv_sqrt_d, tok[:, None], heads, live, j, jm, cos,
                  sin, stride_qo_t, stride_qo_h, D, HALF, ROTATE, UPCAST, PRECISION)  # fmt: skip
    else:
        _rotate_k_copy_v(row, kv_ptr, ks_ptr, slot_ptr, r_ptr, inv_sqrt_d, tok, heads, live, j,
                         jm, cos, sin, stride_kind, stride_kb, stride_kt, stride_kh, HQ, HK,
                         BS, D, HALF, FP8, EMULATE_FP8, ROTATE, UPCAST, PRECISION,
                         FRESH_K)  # fmt: skip


@triton.jit
def _hadamard_store(a1, a2, r_ptr, inv_sqrt_d, dst, m, scale, D: tl.constexpr,
                    HALF: tl.constexpr, FP8: tl.constexpr, EMULATE_FP8: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr, dst2=None,
                    SECOND: tl.constexpr = False):  # fmt: skip
    """Store [a1 | a2] (BLOCK_R, D) times the +-1 matrix at r_ptr (in a1's dtype), times
    1 / sqrt(D), at ``dst`` (row pointers; rows where ``m``): float32 sums of exact products,
    rounded to a1's dtype, then to the destination's (fp8: divided by ``scale``). The
    product is made in column chunks of at most 32, so that the accumulators and sign tiles
    of one chunk are live at a time (compiled for sm_90 at BLOCK_R 64: 202 registers a
    thread for the whole kernel, against 255 with the whole (BLOCK_R, D) product).
    ``SECOND``: the rounded product is also stored unquantized at ``dst2``."""
    ty = a1.dtype
    CH: tl.constexpr = 32 if D > 32 else D
    jh = tl.arange(0, HALF)
    cc = tl.arange(0, CH)
    if UPCAST:  # the interpreter multiplies bfloat16 dot operands as raw integers
        a1, a2 = a1.to(tl.float32), a2.to(tl.float32)
    for c in tl.static_range(0, D // CH):
        cols = c * CH + cc
        s1 = tl.load(r_ptr + jh[:, None] * D + cols[None, :])
        s2 = tl.load(r_ptr + (jh + HALF)[:, None] * D + cols[None, :])
        if UPCAST:
            s1, s2 = s1.to(tl.float32), s2.to(tl.float32)
        y = tl.dot(a1, s1, input_precision=PRECISION)
        y = (tl.dot(a2, s2, y, input_precision=PRECISION) * inv_sqrt_d).to(ty)
        if SECOND:
            tl.store(dst2 + cols[None, :], y, mask=m)
        if FP8:
            tl.store(dst + cols[None, :], to_fp8(y.to(tl.float32), scale, EMULATE_FP8), mask=m)
        else:
            tl.store(dst + cols[None, :], y.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rotate_q(row, q_out_ptr, r_ptr, inv_sqrt_d, tok, heads, live, j, jm, cos, sin,
              stride_qo_t, stride_qo_h, D: tl.constexpr, HALF: tl.constexpr,
              ROTATE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    m = live[:, None] & jm[None, :]
    src = row + heads[:, None] * D + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    ty = q_out_ptr.dtype.element_ty
    a1 = (x1 * cos - x2 * sin).to(ty)
    a2 = (x2 * cos + x1 * sin).to(ty)
    dst = q_out_ptr + tok * stride_qo_t + heads[:, None] * stride_qo_h
    if ROTATE:  # a power-of-two head: no padded columns
        _hadamard_store(a1, a2, r_ptr, inv_sqrt_d, dst, live[:, None], 1.0, D, HALF, False,
                        False, UPCAST, PRECISION)  # fmt: skip
    else:
        tl.store(dst + j[None, :], a1, mask=m)
        tl.store(dst + HALF + j[None, :], a2, mask=m)


@triton.jit
def _rotate_k_copy_v(row, kv_ptr, ks_ptr, slot_ptr, r_ptr, inv_sqrt_d, tok, heads, live, j, jm,
                     cos, sin, stride_kind, stride_kb, stride_kt, stride_kh, HQ, HK, BS,
                     D: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr,
                     EMULATE_FP8: tl.constexpr, ROTATE: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, FRESH_K: tl.constexpr):  # fmt: skip
    """``FRESH_K``: the rotated k is also written back over qkv's k (in qkv's dtype, rows
    of the tokens with a cache slot), where prefill attention reads a prompt's
    fresh keys instead of the fp8 cache (``kiln.kernels.prefill_attention``)."""
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    valid = live & (slot >= 0)  # -1: a padding token, its cache slot is left alone
    safe = tl.maximum(slot, 0)[:, None]
    m = valid[:, None] & jm[None, :]
    k_row = row + HQ * D + heads[:, None] * D  # (BLOCK_R, 1): each row's k head
    src = k_row + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    base = kv_ptr + (safe // BS) * stride_kb + (safe % BS) * stride_kt + heads[:, None] * stride_kh
    dst = base + j[None, :]
    # round as the reference does: to the input dtype, then to the cache's (an fp8 cache
    # quantizes the input dtype's value)
    ty = row.dtype.element_ty
    k1 = (x1 * cos - x2 * sin).to(ty)
    k2 = (x2 * cos + x1 * sin).to(ty)
    ks = 1.0
    vs = 1.0
    if FP8:
        ks = tl.load(ks_ptr)
        vs = tl.load(ks_ptr + 1)
    if ROTATE:
        _hadamard_store(k1, k2, r_ptr, inv_sqrt_d, base, valid[:, None], ks, D, HALF, FP8,
                        EMULATE_FP8, UPCAST, PRECISION, k_row, FRESH_K)  # fmt: skip
    else:
        _store_halves(dst, k1, k2, ks, m, HALF, FP8, EMULATE_FP8)
        if FRESH_K:
            tl.store(src, k1, mask=m)
            tl.store(src + HALF, k2, mask=m)
    # v is copied unrotated, in the same two halves (D = 2 * HALF); an fp8 cache stores
    # values transposed per (block, head): dimension j of head h at h * D * BS + j * BS
    src += HK * D
    v1 = tl.load(src, mask=m, other=0.0)
    v2 = tl.load(src + HALF, mask=m, other=0.0)
    if FP8:
        # compiled for sm_90 these stores put a warp's 32 lanes on 32 consecutive rows
        # (one head's consecutive tokens: consecutive bytes of a block when their slots are)
        vt = (safe // BS) * stride_kb + heads[:, None] * (D * BS) + safe % BS
        _store_halves(kv_ptr + stride_kind + vt + j[None, :] * BS, v1, v2, vs, m, HALF * BS,
                      FP8, EMULATE_FP8)  # fmt: skip
    else:
        _store_halves(dst + stride_kind, v1, v2, vs, m, HALF, FP8, EMULATE_FP8)


@triton.jit
def _store_halves(dst, x1, x2, scale, m, second, FP8: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """Store the two halves of a head in the cache's dtype (fp8: divided by ``scale``), the
    second ``second`` elements after the first."""
    if FP8:
        tl.store(dst, to_fp8(x1.to(tl.float32), scale, EMULATE_FP8), mask=m)
        tl.store(dst + second, to_fp8(x2.to(tl.float32), scale, EMULATE_FP8), mask=m)
    else:
        cty = dst.dtype.element_ty
        tl.store(dst, x1.to(cty), mask=m)
        tl.store(dst + second, x2.to(cty), mask=m)


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
    kv_rotation: torch.Tensor | None = None,
    fresh_k: bool = False,
) -> torch.Tensor:
    """Same contract as ``rotary_write_kv_ref``, in one launch (``fresh_k``: the rotated k
    is also written back over qkv's k, see ``_rotate_k_copy_v``). Needs qkv, cos_sin and the
    cache contiguous in their last dim, and an even head_dim (the half-split layout).
    A program takes BLOCK_R rows: consecutive (token, q head) pairs, across tokens, whose
    q heads it rotates into the output; or one kv head of BLOCK_R consecutive tokens, whose
    k heads it rotates and whose v heads it copies into their tokens' cache slots. The
    Hadamard rotation (``kv_rotation``) is two dots of the (BLOCK_R, D / 2) halves with the
    halves of the +-1 matrix, so BLOCK_R is at least 16 then, and 64 for
    prompts, whose many programs would otherwise each load the matrix for a few rows (at
    BLOCK_R = 16 the rotation made an 8,192-token write 3.2 times slower). For prompts with
    the rotation the q programs and the kv programs are two launches: compiled together,
    the kv path's registers (about 210 a thread on sm_90) set the q programs' occupancy
    too; alone the q path fits 128, twice the programs per SM."""
    t = qkv.shape[0]
    d = head_dim
    assert d % 2 == 0 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d
    assert qkv.stride(-1) == 1 and cos_sin.stride(-1) == 1 and kv_cache.stride(-1) == 1
    q_out = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    s = fp8_scales(kv_cache, kv_scale)
    if t == 0:
        return q_out
    half_pad = triton.next_power_of_2(d // 2)
    block_r = max(1, 1024 // half_pad)
    rotate = kv_rotation is not None
    if rotate:
        if not kv_rotation_allowed(d) or kv_rotation.shape != (d, d):
            raise ValueError(
                f"kv_rotation: a ({d}, {d}) matrix and a power-of-two head_dim >= 32 are "
                f"needed, got {tuple(kv_rotation.shape)} and {d}"
            )
        block_r = 64 if t * num_kv_heads >= 64 else 16  # the dots' rows
        signs = kv_rotation.to(device=qkv.device, dtype=qkv.dtype).contiguous()
    upcast = INTERPRET or qkv.dtype == torch.float32
    q_progs = triton.cdiv(t * num_heads, block_r)
    kv_progs = num_kv_heads * triton.cdiv(t, block_r)  # a kv program: one head's tokens
    if rotate and block_r == 64:  # a prompt: q and kv programs launched apart (see above)
        parts = [((q_progs,), 1), ((kv_progs,), 2)]
    else:
        parts = [((q_progs + kv_progs,), 0)]
    for grid, part in parts:
        _launch(grid, part, qkv, positions, cos_sin, slot_mapping, q_out, kv_cache,
                s if s is not None else cos_sin,  # any float32 pointer when unused
                signs if rotate else qkv, d, block_r, s is not None, rotate, upcast,
                fresh_k)  # fmt: skip
    return q_out


def _launch(grid: tuple[int], part: int, qkv: torch.Tensor, positions: torch.Tensor,
            cos_sin: torch.Tensor, slot_mapping: torch.Tensor, q_out: torch.Tensor,
            kv_cache: torch.Tensor, scales: torch.Tensor, signs: torch.Tensor, d: int,
            block_r: int, fp8: bool, rotate: bool, upcast: bool,
            fresh_k: bool = False) -> None:  # fmt: skip
    num_heads = q_out.shape[1]
    num_kv_heads = kv_cache.shape[3]
    _rotary_kv_kernel[grid](
        qkv,
        positions,
        cos_sin,
        slot_mapping,
        q_out,
        kv_cache,
        scales,
        signs,
        d**-0.5,
        qkv.stride(0),
        cos_sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        qkv.shape[0],
        num_heads,
        num_kv_heads,
        kv_cache.shape[2],
        D=d,
        HALF=d // 2,
        HALF_PAD=triton.next_power_of_2(d // 2),
        BLOCK_R=block_r,
        FP8=fp8,
        EMULATE_FP8=INTERPRET,
        ROTATE=rotate,
        UPCAST=upcast,
        PRECISION="ieee" if upcast else "tf32",
        PART=part,
        FRESH_K=fresh_k and part != 1,
        num_warps=4,
        **pdl.kwargs(qkv),
        # the q path alone fits 128 registers without spilling (129 unbounded): four
        # programs an SM instead of three
        **({"maxnreg": 128} if part == 1 and not INTERPRET else {}),
    )


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
    kv_rotation: torch.Tensor | None = None,
    fresh_k: bool = False,
) -> tuple[torch.Tensor, bool]:
    """Dispatcher: the fused Triton kernel on CUDA, the reference elsewhere. ``fresh_k``
    asks the Triton kernel to leave the rotated k in qkv too; the second value says whether
    it did (the reference never does)."""
    args = (qkv, positions, cos_sin, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim)
    args += (kv_scale, kv_rotation)
    unit = qkv.stride(-1) == 1 and cos_sin.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if use_triton(qkv) and unit and head_dim % 2 == 0:
        return rotary_write_kv_triton(*args, fresh_k=fresh_k), fresh_k
    return rotary_write_kv_ref(*args), False
