"""Paged decode attention (one new token per sequence) for GQA, split across programs
along the context (flash-decoding) and reduced in a second kernel.

Grid of the first kernel: (sequence, kv head, split). Each program loads the G query heads
that share its kv head as one (G_PAD, D) tile, walks its share of the sequence's blocks
with an online softmax (``blocks_per_step`` KV blocks per step, tuned at build), and
writes an unnormalized partial output with its running max and sum. The second kernel
merges the splits. With one split (large batches) the first kernel writes the normalized
output itself and the second is not launched. Semantics: ``paged_attention_ref``
restricted to single-token sequences (same masking, same sliding window).

An fp8 (e4m3) cache (values transposed per block, see ``kiln.kernels.attention``): K/V
tiles are converted to the query dtype (exact; float16 for bfloat16 queries, see
``_decode_partial``) before the dots,
the k scale joins the score scale and the v scale multiplies each split's partial output;
the scales are read from a device tensor, so a CUDA graph replays them in place."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.errors import env_int
from kiln.kernels import pdl
from kiln.kernels._triton import INTERPRET
from kiln.kernels.attention import KvScale, fp8_scales
from kiln.kernels.decode_tiles import (
    _chunk_kv,
    _decode_block,
    _merge_splits,
    _softmax_step,
    _splits_run,
)
from kiln.kernels.tuning import tuned

# KILN_DECODE_PREFETCH=0: decode attention reads everything after the PDL wait (before
# 2026-12-02); 1 (default): its first chunk of K and V before it (``_decode_split``)
PREFETCH = env_int(os.environ, "KILN_DECODE_PREFETCH", 1, range(2))
# KILN_DECODE_DIRECT=0: one split also writes partials and launches the reduction (as
# before 2026-12-04); 1 (default): the partial kernel writes the output itself
DIRECT = env_int(os.environ, "KILN_DECODE_DIRECT", 1, range(2))


def prefetch_for(pdl_mode: int) -> int:
    """The kernel's ``PREFETCH`` at PDL mode ``pdl_mode`` (``pdl.mode``): the setting where
    the kernel waits (mode 2), which the early chunk gets ahead of; else 0, since without
    a wait the early chunk only holds registers. Compiled for sm_90 over an fp8 cache with
    4 warps and no PDL (the steps past ``pdl.MAX_ROWS`` rows), prefetching took 1 block a
    step from 126 registers to 199, 2 from 208 to 233, and 4 from 189 to 255 with 288
    bytes spilled (2026-12-04; ``tests/test_decode_sm90.py``)."""
    return PREFETCH if pdl_mode >= 2 else 0


@triton.jit
def _decode_partial(
    q_ptr,
    kv_ptr,
    bt_ptr,
    lens_ptr,
    tok_ptr,
    acc_ptr,
    ml_ptr,
    ks_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kind,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    scale,
    window,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    NB: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHUNKS_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    RUNTIME_SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    PREFETCH: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
    DIRECT: tl.constexpr = False,
):
    # kiln.kernels.pdl; with PREFETCH the wait comes after the loads that no earlier kernel
    # of the step writes (``_decode_split``)
    pdl.pdl_enter(PDL >= 1, PDL >= 2 and PREFETCH == 0)
    s = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    # the splits are the grid's third dimension, not a compile-time constant: one compiled
    # kernel serves every batch size (the eager steps' batches vary from step to step)
    NUM_SPLITS = tl.num_programs(2)
    ctx = tl.load(lens_ptr + s)
    n_blocks = (ctx + BS - 1) // BS
    n_chunks = (n_blocks + NB - 1) // NB
    # with splits shared out at run time, a split past the sequence's chunks does nothing
    # and writes nothing (the reduction reads only the splits that ran; a CUDA graph sized
    # for the longest context otherwise spent most of a short step on empty programs)
    active = sp < _splits_run(n_chunks, NUM_SPLITS) if RUNTIME_SPLIT else sp >= 0
    if active:
        _decode_split(q_ptr, kv_ptr, bt_ptr, tok_ptr, acc_ptr, ml_ptr, ks_ptr, out_ptr,
                      stride_ot, stride_oh, stride_qt, stride_qh, stride_kind, stride_kb,
                      stride_kt, stride_kh, stride_bt, scale, window, s, h, sp, NUM_SPLITS,
                      ctx, n_blocks, n_chunks, G, G_PAD, D, BS, NB, HAS_WINDOW,
                      CHUNKS_PER_SPLIT, PRECISION, RUNTIME_SPLIT, FP8, PREFETCH,
                      PDL >= 2 and PREFETCH == 1, DIRECT)  # fmt: skip


@triton.jit
def _decode_split(q_ptr, kv_ptr, bt_ptr, tok_ptr, acc_ptr, ml_ptr, ks_ptr, out_ptr,
                  stride_ot, stride_oh, stride_qt, stride_qh, stride_kind, stride_kb,
                  stride_kt, stride_kh, stride_bt, scale, window, s, h, sp, NUM_SPLITS, ctx,
                  n_blocks, n_chunks, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  BS: tl.constexpr, NB: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  CHUNKS_PER_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                  RUNTIME_SPLIT: tl.constexpr, FP8: tl.constexpr, PREFETCH: tl.constexpr,
                  WAIT: tl.constexpr, DIRECT: tl.constexpr):  # fmt: skip
    """One split's partial output, running max and sum (``_decode_partial``'s body).

    ``PREFETCH``: the split's first chunk of K and V is loaded before ``WAIT`` (the
    programmatic-dependent-launch wait), with the block table, lengths and token rows: no
    kernel of the step writes them but the one that stores the new token's K and V, so
    after the wait that one row is read again and put in place. The rest (q, the later
    chunks, every store) comes after the wait."""
    tok = tl.load(tok_ptr + s)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = h * G + g
    bt_row = bt_ptr + s * stride_bt
    if RUNTIME_SPLIT:
        # compiled GPU path: each sequence's chunks of NB blocks are shared out evenly
        # among the splits at run time, so one compiled kernel (and one CUDA graph) serves
        # every context length, and the loop runs only over chunks that exist
        per_split = tl.cdiv(n_chunks, NUM_SPLITS)
        c_lo = sp * per_split
    else:
        # interpreter path: a compile-time trip count (the Triton interpreter supports no
        # loop bound loaded from memory); chunks past the end are masked
        c_lo = sp * CHUNKS_PER_SPLIT
    if PREFETCH:
        k0, v0 = _chunk_kv(kv_ptr, bt_row, c_lo, n_blocks, h, stride_kind, stride_kb,
                           stride_kt, stride_kh, D, BS, NB, FP8)  # fmt: skip
        last = tl.maximum(ctx - 1, 0)  # the new token's position
        blk_last = tl.load(bt_row + last // BS).to(tl.int64)
    pdl.pdl_enter(False, WAIT)
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=(g < G)[:, None],
        other=0.0,
    )  # (G_PAD, D)
    m_i = tl.full([G_PAD], -1e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if FP8:
        scale = scale * tl.load(ks_ptr)
        if q.dtype == tl.bfloat16:
            # fp8 -> float16 is one packed instruction on Hopper, fp8 -> bfloat16 is not:
            # the dots run in float16 (bfloat16 values are exact in float16 within its
            # range, so q is only clamped to it)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if PREFETCH:
        # the new token's row as the kernel before this one stored it
        kn = tl.load(kv_ptr + blk_last * stride_kb + (last % BS) * stride_kt + h * stride_kh + d)
        if FP8:  # values transposed per (block, head)
            vn = tl.load(kv_ptr + stride_kind + blk_last * stride_kb + h * (D * BS) + d * BS
                         + last % BS)  # fmt: skip
        else:
            vn = tl.load(kv_ptr + stride_kind + blk_last * stride_kb + (last % BS) * stride_kt
                         + h * stride_kh + d)  # fmt: skip
        new = (c_lo * (NB * BS) + tl.arange(0, NB * BS) == last)[:, None]
        k0 = tl.where(new, kn.to(q.dtype)[None, :], k0.to(q.dtype))
        v0 = tl.where(new, vn.to(q.dtype)[None, :], v0.to(q.dtype))
        # a split past the sequence's chunks does not run (``_decode_partial``); in the
        # interpreter's masked path such a chunk adds nothing
        m_i, l_i, acc = _softmax_step(q, k0, v0, c_lo, ctx, m_i, l_i, acc, scale, window, BS,
                                      NB, HAS_WINDOW, PRECISION, FP8)  # fmt: skip
    # the chunks not prefetched (PREFETCH, 0 or 1, is the number that was); the loops stay
    # in the branches: the interpreter turns a bound assigned in a branch into a tensor
    if RUNTIME_SPLIT:
        for i in range(0, tl.minimum(per_split, n_chunks - c_lo) - PREFETCH):
            m_i, l_i, acc = _decode_block(
                q, kv_ptr, bt_row, c_lo + PREFETCH + i, n_blocks, ctx, h, m_i, l_i, acc,
                stride_kind, stride_kb, stride_kt, stride_kh, scale, window, D, BS, NB,
                HAS_WINDOW, PRECISION, FP8,
            )  # fmt: skip
    else:
        for i in range(0, CHUNKS_PER_SPLIT - PREFETCH):
            m_i, l_i, acc = _decode_block(
                q, kv_ptr, bt_row, c_lo + PREFETCH + i, n_blocks, ctx, h, m_i, l_i, acc,
                stride_kind, stride_kb, stride_kt, stride_kh, scale, window, D, BS, NB,
                HAS_WINDOW, PRECISION, FP8,
            )  # fmt: skip
    if FP8:
        acc = acc * tl.load(ks_ptr + 1)
    if DIRECT:
        # the only split: the output itself, as the reduction would write it from one split
        # (its weight exp(0) = 1, so the same quotient), with no partials and no second
        # kernel (32 launches of 22 us a step at 896 sequences on the H200, 2026-12-04)
        o = acc / l_i[:, None]
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])  # fmt: skip
    else:
        row = (s * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + sp  # (G_PAD,)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=g < G)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=g < G)


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


def default_splits(target_programs: int, batch: int, kv_heads: int) -> int:
    """Splits per sequence and kv head for about ``target_programs`` programs, rounded up to
    a power of two so that few variants compile (before the cap at the chunk count)."""
    return triton.next_power_of_2(max(1, target_programs // (batch * kv_heads)))


def decode_attention_triton(
    q: torch.Tensor,  # (T, Hq, D): the step's queries; rows ``tok`` are decode tokens
    kv_cache: torch.Tensor,  # (2, num_blocks, tokens_per_block, Hk, D)
    block_tables: torch.Tensor,  # (B, max_blocks) int32, one row per decode sequence
    seq_lens: torch.Tensor,  # (B,) int32 context length (the new token included)
    tok: torch.Tensor,  # (B,) int32/64 row of each sequence's token in q / out
    out: torch.Tensor,  # (T, Hq, D), written at rows ``tok``
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    kv_scale: KvScale = None,
    blocks_per_step: int | None = None,
) -> None:
    """``max_seq_len`` bounds every ``seq_lens`` entry (a CUDA graph passes the engine's
    limit). ``num_splits`` defaults to enough programs to fill the GPU (the tuned
    ``target_programs``), rounded to a power of two so that few variants compile.
    ``kv_scale``: an fp8 cache's (k, v) scales (see ``kiln.kernels.attention``).
    ``blocks_per_step``: KV blocks per step of the online softmax (a power of two; default
    the tuned value); splits are made of whole steps. The tuned values are the
    configuration's ``small_batch`` ones at up to its ``max_batch`` sequences, then its
    ``medium_batch`` ones up to theirs, where the build tuned them apart."""
    fp8 = fp8_scales(kv_cache, kv_scale)
    _, _, bs, hk, d = kv_cache.shape
    hq = q.shape[1]
    g = hq // hk
    b = seq_lens.shape[0]
    cfg = tuned("decode_attention")
    for tier in ("small_batch", "medium_batch"):  # latency-bound steps: their own values
        if cfg.get(tier) and b <= cfg[tier]["max_batch"]:
            cfg = cfg[tier]
            break
    nb = blocks_per_step or cfg.get("blocks_per_step", 1)
    if nb < 1 or nb & (nb - 1):
        raise ValueError(f"blocks_per_step must be a power of two >= 1, got {nb}")
    # P @ V contracts over the step's NB * BS tokens, and tl.dot needs K >= 16 on the GPU:
    # caches of fewer than 16 tokens a block take enough blocks a step (both powers of two)
    nb = max(nb, 16 // bs)
    max_chunks = triton.cdiv(triton.cdiv(max_seq_len, bs), nb)
    if num_splits is None:
        num_splits = default_splits(cfg["target_programs"], b, hk)
    num_splits = max(1, min(num_splits, max_chunks))
    runtime_split = not INTERPRET
    if runtime_split:
        per_split = 1  # unused
    else:  # a power of two, so that few kernel variants get compiled as contexts grow
        per_split = triton.next_power_of_2(triton.cdiv(max_chunks, num_splits))
        num_splits = triton.cdiv(max_chunks, per_split)
    direct = bool(DIRECT) and num_splits == 1  # the output from the partial kernel
    rows = 1 if direct else b * hq * num_splits  # (unused stand-ins when direct)
    acc = torch.empty(rows, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(rows, 2, dtype=torch.float32, device=q.device)
    pdl_kw = pdl.kwargs(q)  # both kernels: PDL constant and launch_pdl
    _decode_partial[(b, hk, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        tok,
        acc,
        ml,
        fp8 if fp8 is not None else ml,  # any float32 pointer when unused
        out,
        out.stride(0),
        out.stride(1),
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        scale,
        sliding_window or 0,
        G=g,
        G_PAD=max(16, triton.next_power_of_2(g)),
        D=d,
        BS=bs,
        NB=nb,
        HAS_WINDOW=sliding_window is not None,
        CHUNKS_PER_SPLIT=per_split,
        # float32 caches get full-precision dots (the default would round inputs to tf32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        RUNTIME_SPLIT=runtime_split,
        FP8=fp8 is not None,
        PREFETCH=prefetch_for(pdl_kw["PDL"]),
        DIRECT=direct,
        num_warps=num_warps or cfg["num_warps"],
        **pdl_kw,
    )
    if direct:
        return
    _decode_reduce[(b, hq)](
        acc,
        ml,
        tok,
        seq_lens,
        out,
        out.stride(0),
        out.stride(1),
        hq,
        num_splits,
        D=d,
        SPLITS_PAD=min(16, triton.next_power_of_2(num_splits)),
        SPLIT_ITERS=1 if runtime_split else triton.cdiv(num_splits, 16),
        BS=bs,
        NB=nb,
        RUNTIME_SPLIT=runtime_split,
        **pdl_kw,
    )
