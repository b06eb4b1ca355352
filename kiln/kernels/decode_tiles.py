"""The per-step pieces of paged decode attention (``kiln.kernels.decode_attention``): one
chunk's K and V as stored, one online-softmax step over them, how many splits get chunks,
the reduction kernel and its merge of a block of splits, and rotary with the new K and V's
write done by decode attention itself (``rope``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import pdl


@triton.jit
def _chunk_kv(kv_ptr, bt_row_ptr, c, n_blocks, h, stride_kind, stride_kb, stride_kt, stride_kh,
              D: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
              FP8: tl.constexpr):  # fmt: skip
    """Chunk ``c``'s K and V as stored: the NB KV blocks ``c * NB .. c * NB + NB - 1`` as
    two (NB * BS, D) tiles; blocks at or past ``n_blocks`` read as zeros."""
    d = tl.arange(0, D)
    t = tl.arange(0, NB * BS)
    b = c * NB + t // BS  # each row's block
    active = b < n_blocks
    blk = tl.load(bt_row_ptr + b, mask=active, other=0).to(tl.int64)
    offs = blk[:, None] * stride_kb + (t % BS)[:, None] * stride_kt + h * stride_kh + d[None, :]
    k = tl.load(kv_ptr + offs, mask=active[:, None], other=0.0)  # (NB * BS, D)
    if FP8:
        # values transposed per (block, head): a (D, NB * BS) tile, contiguous along the
        # tokens (the PV dot's reduction), read as its (NB * BS, D) transpose
        vt = blk[None, :] * stride_kb + h * (D * BS) + d[:, None] * BS + (t % BS)[None, :]
        v = tl.trans(tl.load(kv_ptr + stride_kind + vt, mask=active[None, :], other=0.0))
    else:
        v = tl.load(kv_ptr + stride_kind + offs, mask=active[:, None], other=0.0)
    return k, v


@triton.jit
def _softmax_step(q, k, v, c, ctx, m_i, l_i, acc, scale, window, BS: tl.constexpr,
                  NB: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                  FP8: tl.constexpr):  # fmt: skip
    """One step of the online softmax over chunk ``c``'s K and V tiles."""
    if FP8:  # e4m3 values are exact in any wider float; the scales are applied outside
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    t = tl.arange(0, NB * BS)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (G_PAD, NB*BS) fp32
    pos = c * (NB * BS) + t
    valid = pos < ctx
    if HAS_WINDOW:
        valid = valid & (pos > ctx - 1 - window)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_block(
    q, kv_ptr, bt_row_ptr, c, n_blocks, ctx, h, m_i, l_i, acc, stride_kind, stride_kb,
    stride_kt, stride_kh, scale, window,
    D: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, kn=0.0, vn=0.0, last=0,
    NEW: tl.constexpr = False,
):  # fmt: skip
    """One step of the online softmax over chunk ``c`` (``_chunk_kv``, ``_softmax_step``).
    ``NEW``: the token at position ``last`` takes ``kn`` and ``vn`` ((D,), q's dtype) in
    place of what the cache holds (``_rope_qkv``: no kernel before this one wrote it)."""
    k, v = _chunk_kv(kv_ptr, bt_row_ptr, c, n_blocks, h, stride_kind, stride_kb, stride_kt,
                     stride_kh, D, BS, NB, FP8)  # fmt: skip
    if NEW:
        new = (c * (NB * BS) + tl.arange(0, NB * BS) == last)[:, None]
        k = tl.where(new, kn[None, :], k)
        v = tl.where(new, vn[None, :], v)
    return _softmax_step(q, k, v, c, ctx, m_i, l_i, acc, scale, window, BS, NB, HAS_WINDOW,
                         PRECISION, FP8)  # fmt: skip


@triton.jit
def _splits_run(n_chunks, NUM_SPLITS):
    """How many of ``NUM_SPLITS`` splits get chunks when ``n_chunks`` are shared out at run
    time, ``cdiv(n_chunks, NUM_SPLITS)`` each (``_decode_split``); at least one (split 0
    always runs and writes, also for an empty context)."""
    return tl.maximum(tl.cdiv(n_chunks, tl.maximum(tl.cdiv(n_chunks, NUM_SPLITS), 1)), 1)


@triton.jit
def _merge_splits(acc_ptr, ml_ptr, base, start, n_run, m_run, num, den, D: tl.constexpr,
                  SPLITS_PAD: tl.constexpr):  # fmt: skip
    """Splits ``start .. start + SPLITS_PAD - 1`` (those below ``n_run``) merged into the
    running max, weighted output sum and weight sum."""
    sp = start + tl.arange(0, SPLITS_PAD)
    ok = sp < n_run
    m = tl.load(ml_ptr + (base + sp) * 2, mask=ok, other=-1e30)
    lsum = tl.load(ml_ptr + (base + sp) * 2 + 1, mask=ok, other=0.0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (base + sp)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    m_new = tl.maximum(m_run, tl.max(m, 0))
    alpha = tl.exp(m_run - m_new)
    w = tl.exp(m - m_new)
    return m_new, num * alpha + tl.sum(acc * w[:, None], 0), den * alpha + tl.sum(lsum * w, 0)


@triton.jit
def _decode_reduce(
    acc_ptr,
    ml_ptr,
    tok_ptr,
    lens_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    NUM_SPLITS,
    D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BS: tl.constexpr,
    NB: tl.constexpr,
    RUNTIME_SPLIT: tl.constexpr,
    SPLIT_ITERS: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):
    pdl.pdl_enter(PDL >= 1, False)  # kiln.kernels.pdl: the wait follows the inputs' loads
    s = tl.program_id(0)
    hq = tl.program_id(1)
    d = tl.arange(0, D)
    base = (s * num_heads + hq) * NUM_SPLITS
    if RUNTIME_SPLIT:  # only the splits that ran (split 0 always runs)
        n_chunks = ((tl.load(lens_ptr + s) + BS - 1) // BS + NB - 1) // NB
        n_run = _splits_run(n_chunks, NUM_SPLITS)
    tok = tl.load(tok_ptr + s)
    pdl.pdl_enter(False, PDL >= 2)
    # SPLITS_PAD splits at a time with a running max: a (SPLITS_PAD, D) tile, not all of
    # them (256 splits of 128 float32 spilled registers)
    m_run = tl.full([1], -1e30, tl.float32)
    num = tl.zeros([D], tl.float32)
    den = tl.zeros([1], tl.float32)
    # the loops stay in the branches: the interpreter turns a bound assigned in a branch
    # into a tensor
    if RUNTIME_SPLIT:
        for i in range(0, n_run, SPLITS_PAD):
            m_run, num, den = _merge_splits(acc_ptr, ml_ptr, base, i, n_run, m_run, num, den,
                                            D, SPLITS_PAD)  # fmt: skip
    else:  # the interpreter: a compile-time trip count (its scalars are arrays)
        for j in range(0, SPLIT_ITERS):
            m_run, num, den = _merge_splits(acc_ptr, ml_ptr, base, j * SPLITS_PAD, NUM_SPLITS,
                                            m_run, num, den, D, SPLITS_PAD)  # fmt: skip
    o = num / den
    tl.store(out_ptr + tok * stride_ot + hq * stride_oh + d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _rope_table(pos_ptr, cs_ptr, stride_cs, tok, D: tl.constexpr):
    """Token ``tok``'s rotary factors over a head's D values (half-split layout, the
    (positions, D) ``[cos | sin]`` table of ``kiln.kernels.rotary``): cos, and sin negated
    on the first half, so that value d rotates to ``x[d] * c[d] + x[partner(d)] * s[d]``."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    row = cs_ptr + tl.load(pos_ptr + tok).to(tl.int64) * stride_cs + d % HALF
    return tl.load(row), tl.where(d < HALF, -1.0, 1.0) * tl.load(row + HALF)


@triton.jit
def _rope_qkv(qkv_ptr, tok, stride_t, h, heads, gmask, c, s, HQ, HK, D: tl.constexpr):
    """From token ``tok``'s row of the qkv projection (q heads, then k, then v, D values
    each): the query heads ``heads`` ((G_PAD,), rows where ``gmask``) and kv head ``h``'s
    key rotated (``_rope_table``'s c and s, float32, rounded to qkv's dtype as
    ``rotary_write_kv_ref`` rounds them) and its value: q (G_PAD, D), kn and vn (D,)."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    pd = (d + HALF) % D
    row = qkv_ptr + tok * stride_t
    qp = row + heads[:, None] * D
    x = tl.load(qp + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    xp = tl.load(qp + pd[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    ty = qkv_ptr.dtype.element_ty
    q = (x * c[None, :] + xp * s[None, :]).to(ty)
    kp = row + (HQ + h) * D
    kn = (tl.load(kp + d).to(tl.float32) * c + tl.load(kp + pd).to(tl.float32) * s).to(ty)
    vn = tl.load(row + (HQ + HK + h) * D + d)
    return q, kn, vn


@triton.jit
def _write_new(kv_ptr, slot_ptr, tok, h, kn, vn, stride_kind, stride_kb, stride_kt,
               stride_kh, BS: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Kv head ``h``'s new key and value into token ``tok``'s cache slot (a slot of -1, a
    CUDA graph's padding token: nothing), in the cache's dtype."""
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, D)
        dst = kv_ptr + (slot // BS) * stride_kb + (slot % BS) * stride_kt + h * stride_kh + d
        ty = kv_ptr.dtype.element_ty
        tl.store(dst, kn.to(ty))
        tl.store(dst + stride_kind, vn.to(ty))


def check_rope(q: torch.Tensor, kv_cache: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:  # fmt: skip
    """What ``rope`` needs of q (rows of a contiguous qkv projection) and the cache."""
    _, _, _, hk, d = kv_cache.shape
    row = (q.shape[1] + 2 * hk) * d
    # one row's stride is whatever its view made it (a (1, W) slice viewed as (1, Hq, D)
    # has Hq * D): the kernel reads row 0 only
    if q.stride(2) != 1 or q.stride(1) != d or (q.shape[0] > 1 and q.stride(0) < row) or d % 2:
        raise ValueError(f"rope: q must be the q heads of (T, {row}) qkv rows and the head "
                         f"size even, got strides {q.stride()} and head size {d}")  # fmt: skip
    if kv_cache.dtype == torch.float8_e4m3fn:
        raise ValueError("rope: an fp8 KV cache is written by the rotary kernel (its scales "
                         "and key rotation), not by decode attention")  # fmt: skip
    cos_sin = rope[1]
    if cos_sin.stride(-1) != 1 or cos_sin.shape[-1] != d:
        raise ValueError(f"rope: cos_sin must be a contiguous (positions, {d}) table, got "
                         f"shape {tuple(cos_sin.shape)}")  # fmt: skip
