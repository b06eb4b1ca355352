"""The per-step pieces of paged decode attention (``kiln.kernels.decode_attention``): one
chunk's K and V as stored, one online-softmax step over them, how many splits get chunks,
the reduction kernel and its merge of a block of splits, and the merge of all of a kv
head's splits by the split that finishes last (``FUSED_MERGE``) with its counters."""

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
def _merge_heads(acc_ptr, ml_ptr, rows, n_run, G: tl.constexpr, GP: tl.constexpr,
                 D: tl.constexpr, PAD: tl.constexpr, ITERS: tl.constexpr,
                 RUNTIME_SPLIT: tl.constexpr):  # fmt: skip
    """The normalized outputs ((GP, D) float32, rows past G not meaningful) of G heads whose
    split 0 partials are at ``rows`` ((GP,) partial rows), merged over splits
    ``0 .. n_run - 1``, PAD at a time, as ``_decode_reduce`` merges one head's. The loads
    bypass L1 (``.cg``): other programs wrote the partials in this kernel."""
    gi = tl.arange(0, GP)
    m_run = tl.full([GP], -1e30, tl.float32)
    num = tl.zeros([GP, D], tl.float32)
    den = tl.zeros([GP], tl.float32)
    # the loops stay in the branches: the interpreter turns a bound assigned in a branch
    # into a tensor (its trip count is a compile-time one, ITERS)
    if RUNTIME_SPLIT:
        for i in range(0, n_run, PAD):
            m_run, num, den = _merge_step(acc_ptr, ml_ptr, rows, i, n_run, gi < G, m_run, num,
                                          den, D, PAD)  # fmt: skip
    else:
        for j in range(0, ITERS):
            m_run, num, den = _merge_step(acc_ptr, ml_ptr, rows, j * PAD, n_run, gi < G, m_run,
                                          num, den, D, PAD)  # fmt: skip
    return num / tl.where(gi < G, den, 1.0)[:, None]


@triton.jit
def _merge_step(acc_ptr, ml_ptr, rows, start, n_run, gok, m_run, num, den, D: tl.constexpr,
                PAD: tl.constexpr):  # fmt: skip
    sp = start + tl.arange(0, PAD)
    ok = gok[:, None] & (sp < n_run)[None, :]  # (GP, PAD)
    r = rows[:, None] + sp[None, :]
    m = tl.load(ml_ptr + r * 2, mask=ok, other=-1e30, cache_modifier=".cg")
    lsum = tl.load(ml_ptr + r * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + r[:, :, None] * D + d[None, None, :], mask=ok[:, :, None],
                  other=0.0, cache_modifier=".cg")  # fmt: skip
    m_new = tl.maximum(m_run, tl.max(m, 1))
    alpha = tl.exp(m_run - m_new)
    w = tl.exp(m - m_new[:, None])
    return (m_new, num * alpha[:, None] + tl.sum(acc * w[:, :, None], 1),
            den * alpha + tl.sum(lsum * w, 1))  # fmt: skip


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least ``n`` int32 counters on ``device``, all zero between calls (the last split
    of each (sequence, kv head) sets its counter back): one buffer a device, grown (the
    old ones kept, for the CUDA graphs captured on them) but never during a capture, where
    None (the caller launches the reduction instead). The kernels of one device run in one
    stream, one after another: they share the counters."""
    held = _COUNTERS.setdefault(device, [])
    if held and held[-1].numel() >= n:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    held.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return held[-1]
