"""The per-step pieces of paged decode attention (``kiln.kernels.decode_attention``): one
chunk's K and V as stored, one online-softmax step over them, how many splits get chunks,
and the reduction's merge of a block of splits."""

from __future__ import annotations

import triton
import triton.language as tl


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
    PRECISION: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over chunk ``c`` (``_chunk_kv``, ``_softmax_step``)."""
    k, v = _chunk_kv(kv_ptr, bt_row_ptr, c, n_blocks, h, stride_kind, stride_kb, stride_kt,
                     stride_kh, D, BS, NB, FP8)  # fmt: skip
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
